"""Surge: temporary members at the target version for the length of an upgrade (Jet's enlarged cluster), so
the fleet's capacity does not drop while each member drains and restarts.

They join before the first drain and leave once every member is upgraded, drained like any member (their jobs move
to the upgraded members), then stopped and removed. The upgrade's progress row records them, so a retried step
neither adds a second set nor forgets one.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from changeover import audit, jobs
from changeover.cluster import IDLE_STOP_GRACE, Membership
from changeover.registry.db import lock_row, session_scope
from changeover.registry.models import Member, UpgradeRun
from changeover.settings import Settings
from changeover.upgrade import drain, lock

PREFIX = "surge-"


def add(settings: Settings, cluster: Membership, upgrade_key: str, target: str, count: int) -> list[str]:
    """Start `count` surge members at the target version, once per upgrade. Returns their names."""
    with session_scope(settings.database_url) as s:
        run = _locked(s, upgrade_key)
        progress = dict(run.progress or {})
        names = list(progress.get("surge", {}).get("members", []))
        if not names:
            taken = set(s.scalars(select(Member.name)))
            serving_light = bool(s.scalar(select(Member.name).where(Member.light_jobs.is_(True)).limit(1)))
            names = [n for n in (f"{PREFIX}{i}" for i in range(1, count + len(taken) + 2)) if n not in taken][:count]
            progress["surge"] = {"members": names, "removed": [], "light_jobs": serving_light}
            run.progress = progress
            audit.record(s, "upgrade.surge.add", "upgrade", upgrade_key, members=names, version=target)
        light_jobs = bool(progress["surge"].get("light_jobs"))
        done = set(progress["surge"].get("started", [])) | set(progress["surge"].get("removed", []))
    for name in names:
        if name in done:  # started once: a later step must not restart one its removal is draining
            continue
        cluster.start_worker(name, target, light_jobs=light_jobs)
        with session_scope(settings.database_url) as s:
            run = _locked(s, upgrade_key)
            progress = dict(run.progress or {})
            progress["surge"] = {**progress["surge"], "started": [*progress["surge"].get("started", []), name]}
            run.progress = progress
    return names


def remove(settings: Settings, cluster: Membership, upgrade_key: str, shutdown_timeout: int | None
           ) -> tuple[str | None, drain.DrainPlan | None]:
    """Drain, stop and remove the surge members, one at a time. Returns the one still draining and its plan, or
    (None, None) once none is left."""
    with session_scope(settings.database_url) as s:
        surge = dict((_locked(s, upgrade_key).progress or {}).get("surge", {}))
    for name in surge.get("members", []):
        if name in surge.get("removed", []):
            continue
        with session_scope(settings.database_url) as s:
            present = s.get(Member, name) is not None
        if present:
            plan = drain.step(settings, cluster, name, shutdown_timeout, upgrade_key=upgrade_key)
            if not plan.done:
                return name, plan
            cluster.stop_worker(name, grace=IDLE_STOP_GRACE)
            cluster.remove_member(name)
        with session_scope(settings.database_url) as s:
            run = _locked(s, upgrade_key)
            progress = dict(run.progress or {})
            progress["surge"] = {**progress["surge"], "removed": [*progress["surge"].get("removed", []), name]}
            run.progress = progress
            audit.record(s, "upgrade.surge.remove", "member", name, upgrade=upgrade_key)
    return None, None


def release_idle(settings: Settings, cluster: Membership, upgrade_key: str) -> list[str]:
    """For an aborted upgrade: stop and remove the surge members no driver runs on. Returns those left, with work
    on them (a drain and `changeover upgrade member` end them later)."""
    with session_scope(settings.database_url) as s:
        surge = dict((_locked(s, upgrade_key).progress or {}).get("surge", {}))
    left = []
    for name in surge.get("members", []):
        with session_scope(settings.database_url) as s:
            present = s.get(Member, name) is not None
        if not present or name in surge.get("removed", []):
            continue
        if jobs.drivers_on(settings, cluster, name):
            left.append(name)
            continue
        cluster.stop_worker(name, grace=IDLE_STOP_GRACE)
        cluster.remove_member(name)
        with session_scope(settings.database_url) as s:
            audit.record(s, "upgrade.surge.remove", "member", name, upgrade=upgrade_key, reason="aborted")
    return left


def leaving(progress: dict[str, Any]) -> str | None:
    """The surge member being drained away, once every member is upgraded (for a trigger's observation)."""
    surge = progress.get("surge") or {}
    phases = progress.get("phases", {})
    if not surge or any(p in ("PENDING", "DRAINING") for p in phases.values()):
        return None
    return next((m for m in surge.get("members", []) if m not in surge.get("removed", [])), None)


def _locked(s: Any, upgrade_key: str) -> UpgradeRun:
    return lock_row(s, UpgradeRun, lock.started(s, upgrade_key).id)
