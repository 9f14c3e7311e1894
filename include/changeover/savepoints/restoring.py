"""Restoring a savepoint: the completed savepoints on record, each file verified against the manifest, the stages laid
out in a fresh checkpoint root, and the sinks aligned with the savepoint's batch."""

from __future__ import annotations

import json
import shutil
from collections.abc import Collection
from pathlib import Path
from typing import Any

from sqlalchemy import select

from changeover import audit
from changeover.errors import ChangeoverError
from changeover.names import check_name, is_safe
from changeover.registry.db import session_scope
from changeover.registry.models import Savepoint
from changeover.registry.records import get_job
from changeover.runtime import checkpoints
from changeover.runtime.sinks import Sink, WriteContext, from_description
from changeover.savepoints.digests import DigestCache
from changeover.settings import Settings

MANIFEST = "manifest.json"


def _sink(description: dict[str, Any] | None, settings: Settings, job: str, stage: str
          ) -> tuple[Sink, WriteContext] | None:
    if not description:
        return None
    return from_description(description, settings.database_url), WriteContext(settings.database_url, job, stage, 0)


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
