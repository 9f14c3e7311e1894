"""Savepoints: a copy of every stage's checkpoint at a committed batch, with a manifest, in a store.

The store is an fsspec filesystem (local by default). A savepoint is built under a staging name
and renamed into place; only then is it registered as COMPLETED.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import fsspec
from sqlalchemy import select

from changeover import audit
from changeover.driver import last_commit
from changeover.errors import ChangeoverError
from changeover.jobs import current_run, get_job, new_checkpoint_root
from changeover.names import check_name
from changeover.registry.db import session_scope
from changeover.registry.models import Savepoint
from changeover.settings import Settings
from changeover.timeutil import as_utc

MANIFEST = "manifest.json"


def request_stop(settings: Settings, job_name: str, reason: str) -> None:
    """Ask the job's driver to stop at its next batch boundary. Asking twice changes nothing."""
    with session_scope(settings.database_url) as s:
        job = get_job(s, job_name)
        if not job.fault_tolerant:
            raise ChangeoverError(f"savepoint of job {job_name}", "it is not fault-tolerant and has no checkpoint",
                                  "cancel it instead, or wait for it to finish")
        if job.desired != "STOP":
            job.desired = "STOP"
            audit.record(s, "job.request_stop", "job", job_name, reason=reason)


def take(settings: Settings, job_name: str, name: str) -> Savepoint:
    """Copy the stopped run's checkpoints into the store. Retrying with the same name returns the same savepoint."""
    check_name("savepoint", name)
    with session_scope(settings.database_url) as s:
        job = get_job(s, job_name)
        existing = s.scalar(select(Savepoint).where(Savepoint.job == job_name, Savepoint.name == name))
        if existing is not None:
            return existing
        run = current_run(s, job)
        if run is None or run.state != "STOPPED" or not run.checkpoint_root:
            state = run.state if run else "never launched"
            raise ChangeoverError(f"savepoint {name!r} of job {job_name}",
                                  f"the job is {state}, not stopped at a batch boundary",
                                  f"stop it first with `changeover savepoint {job_name} {name} --cancel`")
        root, run_id, version = Path(run.checkpoint_root), run.id, run.spark_version
    stages = {p.name: last_commit(p) for p in sorted(root.iterdir()) if p.is_dir()}
    if not stages or all(batch is None for batch in stages.values()):
        raise ChangeoverError(f"savepoint {name!r} of job {job_name}", "the job has no committed batch yet",
                              "let it run until it commits a batch, then take the savepoint")
    fs = fsspec.filesystem("file")
    final = settings.savepoint_dir / job_name / name
    staging = settings.savepoint_dir / job_name / f".staging-{name}"
    if fs.exists(str(staging)):
        fs.rm(str(staging), recursive=True)
    fs.makedirs(str(staging / "stages"), exist_ok=True)
    for stage in stages:
        fs.cp(str(root / stage), str(staging / "stages" / stage), recursive=True)
    size = sum(f.stat().st_size for f in staging.rglob("*") if f.is_file())
    manifest = {"job": job_name, "savepoint": name, "spark_version": version, "run": run_id,
                "stages": stages, "size_bytes": size, "mode": "stop"}
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=2))
    if final.exists():
        shutil.rmtree(final)  # a leftover of a crash before registration: never registered, so never used
    staging.rename(final)
    with session_scope(settings.database_url) as s:
        savepoint = Savepoint(job=job_name, name=name, mode="stop", status="COMPLETED", path=str(final),
                              size_bytes=size, spark_version=version, stages=stages, run_id=run_id)
        s.add(savepoint)
        audit.record(s, "savepoint.create", "savepoint", f"{job_name}/{name}", mode="stop", stages=stages,
                     size_bytes=size, spark_version=version)
        return savepoint


def get_savepoint(s: Any, job_name: str, name: str) -> Savepoint:
    check_name("savepoint", name)
    savepoint = s.scalar(select(Savepoint).where(Savepoint.job == job_name, Savepoint.name == name))
    if savepoint is None or savepoint.status != "COMPLETED":
        known = ", ".join(s.scalars(select(Savepoint.name).where(Savepoint.job == job_name))) or "none"
        raise ChangeoverError(f"savepoint {name!r} of job {job_name}", f"no such savepoint (known: {known})",
                              "list them with `changeover savepoints`")
    return savepoint


def restore(settings: Settings, job_name: str, name: str) -> Path:
    """Copy a savepoint's stages, by stage name, into a fresh checkpoint root for a new run."""
    with session_scope(settings.database_url) as s:
        get_job(s, job_name)
        savepoint = get_savepoint(s, job_name, name)
        source = Path(savepoint.path) / "stages"
    if not source.is_dir():
        raise ChangeoverError(f"savepoint {name!r} of job {job_name}", f"its files are missing at {source}",
                              "pick another savepoint from `changeover savepoints`")
    root = new_checkpoint_root(settings, job_name)
    fs = fsspec.filesystem("file")
    fs.makedirs(str(root), exist_ok=True)
    for stage in sorted(p.name for p in source.iterdir()):
        fs.cp(str(source / stage), str(root / stage), recursive=True)
    return root


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
