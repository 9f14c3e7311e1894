"""Retiring savepoints: deletes, the retention policy, what crashed builders left (`reconcile`), and the list of
completed ones."""

from __future__ import annotations

import shutil
import socket
from collections.abc import Collection
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import select

from changeover import audit
from changeover.cluster import processes
from changeover.errors import ChangeoverError
from changeover.registry.db import session_scope
from changeover.registry.models import Savepoint, UpgradeRun, utcnow
from changeover.registry.records import get_job
from changeover.savepoints.restoring import get_savepoint
from changeover.settings import Settings
from changeover.timeutil import as_utc


def _held(savepoint: Savepoint) -> bool:
    """Whether a PENDING savepoint's builder may still be at work. On its own host the process is asked
    directly; from another host only the lease in the registry can tell, so it waits for the lease to lapse."""
    if not savepoint.owner:
        return False
    host, pid, ticks = savepoint.owner.split(":", 2)
    if host == socket.gethostname():
        return processes.is_running(int(pid), ticks)  # a builder dead but not yet reaped holds nothing
    return savepoint.lease_until is not None and as_utc(savepoint.lease_until) > utcnow()


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
