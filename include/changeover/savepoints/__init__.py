"""Savepoints: a consistent copy of every stage's checkpoint at a committed batch, with a manifest.

Two modes, as in Flink: `stop` copies the checkpoints of a run that stopped at a batch boundary;
`continue` copies a running job's checkpoints as of their last committed batch, without stopping it.

A savepoint is registered PENDING, built under a staging folder (hard links where the store shares
the checkpoints' filesystem), given a manifest with every file's size and SHA-256, renamed into
place, and only then marked COMPLETED. A crash at any moment leaves a complete savepoint or, after
`reconcile`, none. Restoring verifies every checksum first.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Collection, Iterator
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
from changeover.names import check_name, is_safe
from changeover.registry.db import session_scope
from changeover.registry.models import JobRun, Savepoint, UpgradeRun, utcnow
from changeover.registry.records import LIVE, current_run, get_job
from changeover.registry.states import AT_A_BOUNDARY, Desired
from changeover.runtime import checkpoints, state_partitions
from changeover.runtime.sinks import Sink, WriteContext, from_description
from changeover.savepoints.digests import DigestCache
from changeover.settings import Settings
from changeover.timeutil import as_utc

MANIFEST = "manifest.json"
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


def _held(savepoint: Savepoint) -> bool:
    """Whether a PENDING savepoint's builder may still be at work. On its own host the process is asked
    directly; from another host only the lease in the registry can tell, so it waits for the lease to lapse."""
    if not savepoint.owner:
        return False
    host, pid, ticks = savepoint.owner.split(":", 2)
    if host == socket.gethostname():
        return processes.is_running(int(pid), ticks)  # a builder dead but not yet reaped holds nothing
    return savepoint.lease_until is not None and as_utc(savepoint.lease_until) > utcnow()


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
    """Like seed 002's memory requirement: refuse up front, with the figures, when space is short."""
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


def _sink(description: dict[str, Any] | None, settings: Settings, job: str, stage: str
          ) -> tuple[Sink, WriteContext] | None:
    if not description:
        return None
    return from_description(description, settings.database_url), WriteContext(settings.database_url, job, stage, 0)


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
        savepoint.status, savepoint.size_bytes, savepoint.owner = "COMPLETED", manifest["size_bytes"], None
        savepoint.lease_until = None
        audit.record(s, "savepoint.create", "savepoint", f"{job_name}/{name}", job=job_name, mode=mode,
                     stages=source.stages, size_bytes=manifest["size_bytes"], spark_version=source.version,
                     hard_links=link)
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


def completed_in(s: Any, job_name: str, name: str) -> Savepoint | None:
    """The job's completed savepoint of that name, in session `s`; None when there is none."""
    return s.scalar(select(Savepoint).where(Savepoint.job == job_name, Savepoint.name == name,
                                            Savepoint.status == "COMPLETED"))


def completed(settings: Settings, job_name: str, name: str) -> Savepoint:
    """The job's completed savepoint of that name; refused, with those it has, when there is none."""
    with session_scope(settings.database_url) as s:
        return get_savepoint(s, job_name, name)


def get_savepoint(s: Any, job_name: str, name: str) -> Savepoint:
    check_name("savepoint", name)
    savepoint = completed_in(s, job_name, name)
    if savepoint is None:
        known = ", ".join(s.scalars(select(Savepoint.name).where(
            Savepoint.job == job_name, Savepoint.status == "COMPLETED"))) or "none"
        raise ChangeoverError(f"savepoint {name!r} of job {job_name}", f"no such savepoint (known: {known})",
                              "list them with `changeover savepoints`")
    return savepoint


def verify(path: Path) -> dict[str, Any]:
    """Check every file against the manifest. A missing, truncated or altered file is refused by name."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise ChangeoverError(f"savepoint at {path}", f"its manifest cannot be read ({exc})",
                              "resume from another savepoint; this one is not usable") from None
    for stage in manifest.get("stages", {}):
        _inside(path, manifest, f"stages/{stage}/", stage)
    for relative, expected in manifest["files"].items():
        _inside(path, manifest, relative)
        file = path / relative
        reason = None
        if not file.is_file():
            reason = "the file is missing"
        elif file.stat().st_size != expected["size"]:
            reason = f"the file has {file.stat().st_size:,} bytes, the manifest says {expected['size']:,}"
        elif DigestCache.sha256(file) != expected["sha256"]:
            reason = "its SHA-256 differs from the manifest's"
        if reason:
            raise ChangeoverError(f"savepoint {manifest['job']}/{manifest['savepoint']}",
                                  f"{relative} is corrupted: {reason}",
                                  "resume from another savepoint (`changeover savepoints`); this one is not usable")
    return manifest


def _inside(path: Path, manifest: dict[str, Any], relative: str, stage: str | None = None) -> None:
    """A manifest is data read from disk: its paths must stay inside the savepoint, through no `..`, absolute
    path or link, and its stage names must be names, since they become checkpoint folders on restore."""
    why = None
    if stage is not None and not is_safe(stage):
        why = f"its stage name {stage!r} is not a safe folder name"
    elif Path(relative).is_absolute() or ".." in Path(relative).parts:
        why = f"its file path {relative!r} leaves the savepoint"
    elif not (path / relative).resolve().is_relative_to(path.resolve()):
        why = f"its file path {relative!r} leads out of the savepoint through a link"
    if why:
        raise ChangeoverError(f"savepoint {manifest.get('job')}/{manifest.get('savepoint')}", why,
                              "resume from another savepoint; do not edit a savepoint's manifest by hand")


def restore(
    settings: Settings,
    job_name: str,
    name: str,
    *,
    source_job: str | None = None,
    rename: dict[str, str] | None = None,
    rewind_sink: bool = False,
    accept_duplicates: bool = False,
    follower: bool = False,
    rescaled: Collection[str] = (),
) -> Path:
    """Verify a savepoint (of source_job, by default job_name itself), then lay its stages out, by stage
    name and through the rename map, in a fresh checkpoint root of job_name. A follower's checkpoint leaves the
    sinks as they are: it writes nothing until it has replayed the live run's batches up to the sinks' own.
    `rescaled`: stages (by their new names) whose state the new run repartitions first, which puts a batch of its
    own before the planned one: the planned batch is replayed under the next id, so a sink that has it already must
    be rewound."""
    rename = dict(rename or {})
    with session_scope(settings.database_url) as s:
        get_job(s, job_name)
        path = Path(get_savepoint(s, source_job or job_name, name).path)
    manifest = verify(path)
    stages = manifest["stages"]
    for old, new in rename.items():
        check_name("stage", new)
        if old not in stages:
            raise ChangeoverError(f"stage rename {old}={new}", f"savepoint {name!r} has no stage {old!r} "
                                  f"(it has {', '.join(stages)})", "rename one of the savepoint's stages")
    if (source_job or job_name) == job_name and not follower:  # another job's copy starts its own sinks' ledgers
        _align_sinks(settings, job_name, name, path, {rename.get(st, st): info for st, info in stages.items()},
                     rewind_sink, accept_duplicates, rescaled)
    root = checkpoints.new_checkpoint_root(settings, job_name)
    link = checkpoints.same_filesystem(path, root.parent)
    for relative in manifest["files"]:
        parts = Path(relative).parts
        if parts[0] != "stages":
            continue
        target = root / rename.get(parts[1], parts[1]) / Path(*parts[2:])
        if checkpoints.materialise(path / relative, target, link=link) is None:
            shutil.rmtree(root, ignore_errors=True)
            raise ChangeoverError(f"restore of savepoint {name!r} into job {job_name}",
                                  f"{relative} vanished while it was being laid out",
                                  "check that nothing deletes savepoints meanwhile (retention, `savepoint delete`), "
                                  "then resume again")
    with session_scope(settings.database_url) as s:
        audit.record(s, "savepoint.restore", "savepoint", f"{source_job or job_name}/{name}", job=job_name,
                     into=str(root), rename=rename, rewind_sink=rewind_sink, **({"follower": True} if follower else {}))
    return root


def _align_sinks(settings: Settings, job: str, name: str, path: Path, stages: dict[str, Any], rewind: bool,
                 accept_duplicates: bool, rescaled: Collection[str] = ()) -> None:
    """A sink's progress is not in the checkpoint: a sink ahead of the savepoint would skip the batches the
    restored query replays (files, keyed tables) or deliver them twice (an at-least-once foreachBatch)."""
    for stage, info in stages.items():
        if (found := _sink(info.get("sink"), settings, job, stage)) is None:
            raise ChangeoverError(f"resume of job {job} from savepoint {name!r}",
                                  f"the savepoint does not say which sink stage {stage} writes (it predates "
                                  "declared sinks, or the run never reported them), so whether the sink is ahead "
                                  "of it cannot be checked", "resume from a savepoint taken since")
        declared, context = found
        written = declared.progress(context)
        duplicates = declared.guarantee == "at-least-once"
        # Batches the savepoint holds offsets for are replayed with the same offsets: a sink that recognises a
        # replay may have them, and an at-least-once one gets that one batch again, which is its declared
        # guarantee (before, a move whose stop caught the next batch begun was refused on every try until its
        # lease ran out). A rewind asked for (a rollback to other code) takes them back too, so the replay writes
        # them from the code now resumed.
        replayed = info.get("replay_through") or -1
        limit = info["batch"] if rewind or stage in rescaled else max(info["batch"], replayed)
        if written is None or written <= limit:
            continue
        if (duplicates and not accept_duplicates) or (not duplicates and declared.guarantee != "idempotent"
                                                      and not rewind):
            how = ("pass --accept-duplicates to deliver those batches again, duplicates and all"
                   if duplicates else "pass --rewind-sink to make the sink as it was at the savepoint's batch, "
                   "so the replayed batches are written again")
            if stage in rescaled:
                how += " (its state is repartitioned, which replays the planned batch under the next batch id)"
            raise ChangeoverError(
                f"resume of job {job} from savepoint {name!r}",
                f"the {declared.kind} sink of stage {stage} is ahead of the savepoint: it wrote up to batch "
                f"{written}, the savepoint stands at batch {info['batch']}, so the replayed batches would be "
                + ("delivered twice" if duplicates else "skipped as already written and their rows lost"),
                f"{how}, or resume from a newer savepoint")
        saved = path / "sinks" / stage
        done = declared.rewind(context, info["batch"], saved if saved.is_dir() else None)
        with session_scope(settings.database_url) as s:
            audit.record(s, "sink.rewind", "job", job, stage=stage, sink=declared.kind, to_batch=info["batch"],
                         from_batch=written, savepoint=name, done=done)


def delete(settings: Settings, job_name: str, name: str) -> None:
    with session_scope(settings.database_url) as s:
        savepoint = get_savepoint(s, job_name, name)
        if _held_by_upgrade(s, savepoint):
            raise ChangeoverError(f"delete of savepoint {name!r} of job {job_name}",
                                  f"the unfinished upgrade {savepoint.upgrade_key} refers to it",
                                  "finish or fail that upgrade first")
        path = Path(savepoint.path)
        s.delete(savepoint)
        audit.record(s, "savepoint.delete", "savepoint", f"{job_name}/{name}", job=job_name)
    shutil.rmtree(path, ignore_errors=True)


def _held_by_upgrade(s: Any, savepoint: Savepoint) -> bool:
    if not savepoint.upgrade_key:
        return False
    run = s.scalar(select(UpgradeRun).where(UpgradeRun.key == savepoint.upgrade_key))
    return run is not None and run.status == "RUNNING"


def apply_retention(settings: Settings, job_name: str, max_count: int | None = None,
                    max_age: timedelta | None = None) -> list[str]:
    """Delete savepoints beyond max_count or older than max_age; never the newest, never one in use."""
    now = utcnow()
    with session_scope(settings.database_url) as s:
        get_job(s, job_name)
        completed = list(s.scalars(select(Savepoint).where(
            Savepoint.job == job_name, Savepoint.status == "COMPLETED").order_by(Savepoint.created_at.desc(),
                                                                                  Savepoint.id.desc())))
        doomed = [
            sp.name for index, sp in enumerate(completed)
            if index > 0 and not _held_by_upgrade(s, sp)
            and ((max_count is not None and index >= max_count)
                 or (max_age is not None and now - as_utc(sp.created_at) > max_age))
        ]
    for name in doomed:
        delete(settings, job_name, name)
    return doomed


def reconcile(settings: Settings, only: Collection[str] | None = None, dry_run: bool = False) -> dict[str, list[str]]:
    """Remove what crashed savepoints left: PENDING rows, their folders, and staging leftovers.

    only: remove just these names (rows as "job/name", folders relative to the store, as returned), for a caller
    that waits out a grace before it removes anything (the leak checker); dry_run: remove nothing, only say what
    would go."""
    removed: dict[str, list[str]] = {"rows": [], "folders": []}
    # Folders first, rows second: a builder writes its row before its folder, so every folder seen here has its row
    # in the read below, also one published meanwhile (read the other way round, its folder looked orphaned).
    store = settings.savepoint_dir
    folders = sorted(p for p in store.glob("*/*") if p.is_dir()) if store.exists() else []
    with session_scope(settings.database_url) as s:
        pending = [sp for sp in s.scalars(select(Savepoint).where(Savepoint.status != "COMPLETED"))
                   if not _held(sp) and (only is None or f"{sp.job}/{sp.name}" in only)]
        busy = {(sp.job, sp.name) for sp in s.scalars(select(Savepoint).where(Savepoint.status != "COMPLETED"))
                if _held(sp)}
        for sp in pending:
            removed["rows"].append(f"{sp.job}/{sp.name}")
            if not dry_run:
                shutil.rmtree(sp.path, ignore_errors=True)
                s.delete(sp)
        if removed["rows"] and not dry_run:
            audit.record(s, "savepoint.reconcile", "savepoint", "*", removed=removed["rows"])
        # the rows removed above (or that a dry run would remove) no longer name their folders
        registered = {(sp.job, sp.name) for sp in s.scalars(select(Savepoint))} - {(sp.job, sp.name) for sp in pending}
    for folder in folders:
        key = (folder.parent.name, folder.name.removeprefix(".staging-"))
        leftover = folder.name.startswith(".staging-") and key not in busy
        orphan = not folder.name.startswith(".") and key not in registered  # e.g. a delete cut short
        name = str(folder.relative_to(store))
        if (leftover or orphan) and (only is None or name in only):
            if not dry_run:
                shutil.rmtree(folder, ignore_errors=True)
            removed["folders"].append(name)
    return removed


def list_savepoints(settings: Settings, job: str | None = None) -> list[dict[str, Any]]:
    with session_scope(settings.database_url) as s:
        query = select(Savepoint).where(Savepoint.status == "COMPLETED").order_by(Savepoint.created_at)
        if job:
            get_job(s, job)
            query = query.where(Savepoint.job == job)
        return [
            {"time": as_utc(sp.created_at).isoformat(timespec="milliseconds"), "size_bytes": sp.size_bytes,
             "job": sp.job, "name": sp.name, "spark_version": sp.spark_version, "mode": sp.mode,
             "stages": sp.stages}
            for sp in s.scalars(query)
        ]
