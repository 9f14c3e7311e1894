"""Taking a savepoint: the stop asked of a job, the source run's checkpoint at its last commit, the builder's lease,
and the copy, manifest and publication (`take`). See the package's docstring for the steps."""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import OperationalError

from changeover import audit, faults
from changeover.cluster import processes
from changeover.errors import ChangeoverError
from changeover.handoff import lease as job_lease
from changeover.names import check_name
from changeover.registry.db import session_scope
from changeover.registry.models import JobRun, Savepoint, utcnow
from changeover.registry.records import LIVE, current_run, get_job
from changeover.registry.states import AT_A_BOUNDARY, Desired
from changeover.runtime import checkpoints, state_partitions
from changeover.savepoints.digests import DigestCache
from changeover.savepoints.restoring import MANIFEST, _sink, completed_in
from changeover.savepoints.retention import _held, reconcile
from changeover.settings import Settings

FORMAT = 2  # 2: each stage names its sink, and a file sink's log as of the batch is kept under sinks/
MODES = ("stop", "continue")


def request_stop(settings: Settings, job_name: str, reason: str, move: bool = False) -> None:
    """Ask the job's driver to stop at its next batch boundary. Asking twice changes nothing.

    move: the stop is for a move, so the driver parks and resumes by itself if the move does not finish.
    """
    with session_scope(settings.database_url) as s:
        job = get_job(s, job_name)
        if not job.fault_tolerant:
            raise ChangeoverError(f"savepoint of job {job_name}", "it is not fault-tolerant and has no checkpoint",
                                  "cancel it instead, or wait for it to finish")
        wanted = "MOVE" if move else "STOP"
        if job.desired == Desired.STOP and move:
            return  # a user's stop stands: a move never turns it into a park
        if job.desired != wanted:
            job.desired = wanted
            audit.record(s, "job.request_stop", "job", job_name, reason=reason, park=move)


def _owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{processes.start_ticks(os.getpid())}"


def lease_seconds() -> float:
    """How long a savepoint being built stays held without its builder renewing the lease."""
    return float(os.environ.get("CHANGEOVER_SAVEPOINT_LEASE_SECONDS") or 60)


def _ours(job_name: str, name: str, owner: str) -> Any:
    return select(Savepoint).where(Savepoint.job == job_name, Savepoint.name == name, Savepoint.owner == owner,
                                   Savepoint.status == "PENDING")


@dataclass
class _Lease:
    """This builder's hold on a PENDING savepoint. `lost` once a renewal found the row no longer ours, or the
    lease ran out before a renewal got through: another host may then have cleared it and begun anew."""

    owner: str
    until: float  # monotonic
    lost: bool = False

    def check(self, what: str) -> None:
        if self.lost or time.monotonic() > self.until:
            self.lost = True
            raise ChangeoverError(what, "this builder lost its lease on it (the registry was out of reach for "
                                  "longer than the lease, or another process cleared it)", "take it again")


@contextlib.contextmanager
def _leased(settings: Settings, job_name: str, name: str, owner: str,
            parked_run: int | None = None) -> Iterator[_Lease]:
    """Renew the savepoint's lease every third of its length while the body works, so other hosts leave it be, and
    the lease of the parked run it is built from (`lease.extend`), so that run waits for its move."""
    lease = _Lease(owner, time.monotonic() + lease_seconds())
    done = threading.Event()
    parked_length = job_lease.extend(settings.database_url, job_name, parked_run) if parked_run else None

    def renew() -> None:
        nonlocal parked_length
        while not done.wait(min(lease_seconds(), parked_length or lease_seconds()) / 3):
            asked = time.monotonic()
            try:
                with session_scope(settings.database_url) as s:
                    row = s.scalar(_ours(job_name, name, owner))
                    if row is None:
                        lease.lost = True
                        return
                    row.lease_until = utcnow() + timedelta(seconds=lease_seconds())
                lease.until = asked + lease_seconds()
                if parked_length is not None and parked_run is not None:
                    parked_length = job_lease.extend(settings.database_url, job_name, parked_run)
            except OperationalError:
                continue  # the registry busy or away for a moment; `check` notices if it is away too long

    # in this context: its events name the task's actor and upgrade (`audit.act_as`), as the builder's do
    keeper = threading.Thread(target=contextvars.copy_context().run, args=(renew,),
                              name=f"savepoint-lease-{job_name}-{name}", daemon=True)
    keeper.start()
    try:
        yield lease
    finally:
        done.set()
        keeper.join()


@dataclass(frozen=True)
class _Source:
    root: Path
    run_id: int
    version: str
    code: str | None
    stages: dict[str, int]
    operators: dict[str, Any]  # stage -> the driver's `state-metadata` rows
    sinks: dict[str, Any]  # stage -> its sink's description, as the driver recorded it
    plans: dict[str, Any]  # stage -> its stateful plan, as the driver recorded it


def _source(settings: Settings, job_name: str, name: str, mode: str, of_run: int | None = None) -> _Source:
    with session_scope(settings.database_url) as s:
        job = get_job(s, job_name)
        run = current_run(s, job) if of_run is None else s.get(JobRun, of_run)
        run = run if run is None or run.job == job_name else None
        state = run.state if run else "never launched"
        wanted = AT_A_BOUNDARY if mode == "stop" else (*LIVE, *AT_A_BOUNDARY)
        if run is None or run.state not in wanted or not run.checkpoint_root:
            how = (f"stop it with `changeover savepoint {job_name} {name} --cancel`" if mode == "stop"
                   else "start it first")
            raise ChangeoverError(f"savepoint {name!r} of job {job_name}",
                                  f"the job is {state}, and a {mode} savepoint needs it "
                                  + ("stopped at a batch boundary" if mode == "stop" else "running"), how)
        root, run_id, version, code = Path(run.checkpoint_root), run.id, run.spark_version, job.code
        operators, sinks, plans = dict(run.operators or {}), dict(run.sinks or {}), dict(run.plans or {})
    if (root / state_partitions.RESCALING).exists():
        raise ChangeoverError(f"savepoint {name!r} of job {job_name}", f"its run {run_id} is repartitioning its "
                              "state, and a savepoint then would hold half of it",
                              "retry once the run has started its queries (a run that failed meanwhile: resume "
                              "the job from its savepoint, or submit it again to finish the repartition)")
    stages = {name: checkpoints.last_commit(root / name) for name in checkpoints.stage_names(root)}
    committed = {stage: batch for stage, batch in stages.items() if batch is not None}
    if not committed:
        raise ChangeoverError(f"savepoint {name!r} of job {job_name}", "the job has no committed batch yet",
                              "let it run until it commits a batch, then take the savepoint")
    return _Source(root, run_id, version, code, committed, operators, sinks, plans)


def _check_space(settings: Settings, source: _Source, store: Path, link: bool, name: str) -> None:
    """As a job update's exported snapshot needs room of its own: refuse up front, with the figures, when space
    is short."""
    headroom = int(os.environ.get("CHANGEOVER_SAVEPOINT_HEADROOM_BYTES", 64 * 1024 * 1024))
    expected = 0 if link else sum(
        f.stat().st_size for stage in source.stages for f in (source.root / stage).rglob("*") if f.is_file())
    free = shutil.disk_usage(store).free
    if free < expected + headroom:
        raise ChangeoverError(
            f"savepoint {name!r}", f"{free:,} bytes are free in {store}, and it needs {expected:,} bytes "
            f"plus {headroom:,} bytes of headroom ({'hard links' if link else 'a full copy'})",
            "free some space, delete old savepoints with `changeover savepoint delete`, or move the store")


def code_fingerprint(code: str | None) -> str | None:
    """SHA-256 of the job's code artifact, so a later resume can tell the code changed."""
    return DigestCache.sha256(Path(code)) if code and Path(code).is_file() else None


def take(
    settings: Settings,
    job_name: str,
    name: str,
    mode: str = "stop",
    upgrade_key: str | None = None,
    exist_ok: bool = False,
    of_run: int | None = None,
) -> Savepoint:
    """Take a savepoint. With exist_ok (a retried task), a completed one of that name is returned, never
    a second one; otherwise the name must be new. of_run: a `stop` savepoint of that run of the job rather than of
    its current one (a zero-downtime move's predecessor, stopped on its last batch after the cut-over)."""
    check_name("savepoint", name)
    if mode not in MODES:
        raise ChangeoverError(f"savepoint mode {mode!r}", f"the modes are {', '.join(MODES)}", "pick one of them")
    with session_scope(settings.database_url) as s:
        get_job(s, job_name)
        existing = s.scalar(select(Savepoint).where(Savepoint.job == job_name, Savepoint.name == name))
        if existing is not None and existing.status == "COMPLETED":
            if exist_ok:
                return existing
            raise _duplicate(job_name, name)
        if existing is not None and _held(existing):
            raise ChangeoverError(f"savepoint {name!r} of job {job_name}", "another process is taking it now",
                                  "wait for it, or pick another name")
    if existing is not None:
        reconcile(settings)  # a crashed attempt under this name: clear it, then start over
    source = _source(settings, job_name, name, mode, of_run)
    store = settings.savepoint_dir / job_name
    link = checkpoints.same_filesystem(source.root, store)
    _check_space(settings, source, store, link, name)
    final = store / name
    with session_scope(settings.database_url) as s:
        s.add(Savepoint(job=job_name, name=name, mode=mode, status="PENDING", path=str(final), size_bytes=0,
                        spark_version=source.version, stages=source.stages, run_id=source.run_id,
                        upgrade_key=upgrade_key, owner=(owner := _owner()),
                        lease_until=utcnow() + timedelta(seconds=lease_seconds())))
    parked = source.run_id if mode == "stop" else None
    with _leased(settings, job_name, name, owner, parked) as lease:
        return _build(settings, job_name, name, mode, source, store, final, link, lease)


def _build(settings: Settings, job_name: str, name: str, mode: str, source: _Source, store: Path, final: Path,
           link: bool, lease: _Lease) -> Savepoint:
    """Copy, describe and publish a savepoint whose PENDING row is written; see `take`. Each builder stages
    in a folder of its own, and publishes only while its lease holds, so two never mix their files."""
    faults.crash("pending")
    staging = store / f".staging-{name}" / lease.owner.replace(":", "-")
    shutil.rmtree(staging, ignore_errors=True)
    copied: dict[str, os.stat_result] = {}
    for stage, batch in source.stages.items():
        stats = checkpoints.snapshot_stage(source.root / stage, staging / "stages" / stage, batch, link=link,
                                           prefix=f"stages/{stage}/")
        copied.update(stats.files)
        copied.update(checkpoints.snapshot_pending(source.root / stage, staging / "stages" / stage, batch,
                                                   prefix=f"stages/{stage}/").files)
        faults.crash("copying")
        faults.point(settings, f"savepoint.copying.{mode}")
    sink_batches: dict[str, int | None] = {}
    for stage, batch in source.stages.items():
        if (found := _sink(source.sinks.get(stage), settings, job_name, stage)) is not None:
            declared, context = found
            sink_batches[stage] = declared.progress(context)
            saved = staging / "sinks" / stage
            declared.snapshot(context, batch, saved)
            for file in (p for p in saved.rglob("*") if p.is_file()) if saved.exists() else []:
                copied[str(file.relative_to(staging))] = file.stat()
    faults.crash("copied")
    digests = DigestCache(store / ".digests.json")
    files = {relative: {"size": st.st_size, "sha256": digests.of(os.path.join(staging, relative), st)}
             for relative, st in sorted(copied.items())}
    digests.save()
    manifest = {
        "format": FORMAT, "job": job_name, "savepoint": name, "mode": mode,
        "created_at": utcnow().isoformat(), "spark_version": source.version, "run": source.run_id,
        "code_fingerprint": code_fingerprint(source.code),
        "size_bytes": sum(f["size"] for f in files.values()),
        "stages": {
            stage: {
                "batch": batch,
                "source_offsets": checkpoints.source_offsets(staging / "stages" / stage, batch),
                "operators": describe_operators(source.operators.get(stage),
                                                checkpoints.stateful_operators(staging / "stages" / stage)),
                "replay_through": checkpoints.last_offsets(staging / "stages" / stage),
                "sink": source.sinks.get(stage),
                "plan": source.plans.get(stage),
                "sink_batch": sink_batches.get(stage),
                # pinned in the offset log: a resume keeps it unless it repartitions (--state-partitions)
                "state_partitions": state_partitions.partitions(staging / "stages" / stage, batch),
                "state_store": state_partitions.provider(staging / "stages" / stage),
            }
            for stage, batch in source.stages.items()
        },
        "files": files,
    }
    _write_durably(staging / MANIFEST, json.dumps(manifest, separators=(",", ":")))
    faults.crash("manifest")
    return _publish_staged(settings, job_name, name, mode, source, staging, final, link, lease, manifest["size_bytes"])


def _publish_staged(settings: Settings, job_name: str, name: str, mode: str, source: _Source, staging: Path,
                    final: Path, link: bool, lease: _Lease, size_bytes: int) -> Savepoint:
    """The staged savepoint renamed into place and marked COMPLETED (`_build`'s last step)."""
    what = f"savepoint {name!r} of job {job_name}"
    with session_scope(settings.database_url) as s:
        # Publish under the row's lock, and only while it is ours: a builder that lost its lease backs off.
        savepoint = s.scalar(_ours(job_name, name, lease.owner).with_for_update())
        try:
            if savepoint is None:
                lease.lost = True
            lease.check(what)
        except ChangeoverError:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        shutil.rmtree(final, ignore_errors=True)  # only ever a leftover of a crash: its row was never COMPLETED
        os.rename(staging, final)
        with contextlib.suppress(OSError):
            staging.parent.rmdir()
        faults.crash("moved")
        savepoint.status, savepoint.size_bytes, savepoint.owner = "COMPLETED", size_bytes, None
        savepoint.lease_until = None
        audit.record(s, "savepoint.create", "savepoint", f"{job_name}/{name}", job=job_name, mode=mode,
                     stages=source.stages, size_bytes=size_bytes, spark_version=source.version, hard_links=link)
        return savepoint


def describe_operators(reader_rows: list[dict[str, Any]] | None, from_files: list[dict[str, Any]]
                       ) -> list[dict[str, Any]]:
    """Each stateful operator: id, name and stores from Spark's `state-metadata` reader (as the driver read
    it), key and value schemas with field names from the schema files. Without reader rows (the driver
    has not reported yet) the operator metadata files stand in, and the entry says so."""
    by_id = {entry["operator_id"]: entry for entry in from_files}
    if reader_rows is None:
        return [{**entry, "read_by": "metadata files"} for entry in from_files]
    described: dict[int, dict[str, Any]] = {}
    for row in reader_rows:
        entry = described.setdefault(row["operatorId"], {
            "operator_id": row["operatorId"], "operator_name": row["operatorName"], "state_stores": [],
            "num_partitions": row["numPartitions"], "read_by": "state-metadata",
            **{k: v for k, v in by_id.get(row["operatorId"], {}).items() if k.endswith("_schema")},
        })
        entry["state_stores"].append(row["stateStoreName"])
    return list(described.values())


def _duplicate(job_name: str, name: str) -> ChangeoverError:
    return ChangeoverError(f"savepoint {name!r} of job {job_name}", "a savepoint of that name exists",
                           "pick another name, or delete the old one with `changeover savepoint delete`")


def check_available(settings: Settings, job_name: str, name: str) -> None:
    """Refuse a taken name before anything is done, e.g. before a job is stopped for it."""
    check_name("savepoint", name)
    with session_scope(settings.database_url) as s:
        get_job(s, job_name)
        taken = completed_in(s, job_name, name)
    if taken is not None:
        raise _duplicate(job_name, name)


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
