"""The upgrade's registry row: the lock that lets one upgrade run at a time, and how an upgrade ends.

The lock is a unique, nullable `active` slot: 1 while the upgrade runs, NULL once it has ended.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from changeover import audit
from changeover.errors import ChangeoverError
from changeover.registry.db import session_scope
from changeover.registry.models import UpgradeRun, utcnow
from changeover.settings import Settings


def begin(settings: Settings, upgrade_key: str, target: str, old: dict[str, str]) -> None:
    """Take the registry lock: one RUNNING upgrade at a time, held by a unique `active` slot."""
    with session_scope(settings.database_url) as s:
        mine = s.scalar(select(UpgradeRun).where(UpgradeRun.key == upgrade_key))
        if mine is not None and mine.active is not None:
            return  # a retried preflight: the lock is ours already
        if mine is not None:
            raise _ended(mine)
        holder = s.scalar(select(UpgradeRun).where(UpgradeRun.active.is_not(None)))
        if holder is not None:
            raise busy(upgrade_key, holder)
    try:
        with session_scope(settings.database_url) as s:
            s.add(UpgradeRun(key=upgrade_key, target_version=target, members=old, status="RUNNING", active=1,
                             actor=audit.current_actor()))
            audit.record(s, "upgrade.begin", "upgrade", upgrade_key, target_version=target, members=old)
    except IntegrityError:
        with session_scope(settings.database_url) as s:
            holder = s.scalar(select(UpgradeRun).where(UpgradeRun.active.is_not(None)))
            if holder is None or holder.key == upgrade_key:
                return
            raise busy(upgrade_key, holder) from None


def started(s: Any, upgrade_key: str) -> UpgradeRun:
    """The upgrade's row, or a refusal: its preflight, an upgrade DAG's first task, starts it."""
    run = s.scalar(select(UpgradeRun).where(UpgradeRun.key == upgrade_key))
    if run is None:
        raise ChangeoverError(f"upgrade {upgrade_key!r}", "no such upgrade was started",
                              "run its preflight first (the upgrade DAG's first task does)")
    return run


def require_active(settings: Settings, upgrade_key: str) -> None:
    """Every step of an upgrade checks it still holds the lock: a cleared task of an ended run changes nothing."""
    with session_scope(settings.database_url) as s:
        run = started(s, upgrade_key)
        if run.active is None:
            raise _ended(run)


def _ended(run: UpgradeRun) -> ChangeoverError:
    return ChangeoverError(f"upgrade {run.key}", f"it has ended as {run.status} and no longer holds the upgrade lock",
                           "trigger a new run of the DAG; it continues from the members' actual state")


def busy(key: str, holder: UpgradeRun) -> ChangeoverError:
    return ChangeoverError(
        f"upgrade {key}", f"upgrade {holder.key} to {holder.target_version} is still running "
        f"(started {holder.started_at:%Y-%m-%d %H:%M:%S} UTC by {holder.actor or 'unknown'})",
        f"wait for it to end; if its Airflow run is gone, release it with `changeover upgrades release {holder.key}`")


def release(settings: Settings, upgrade_key: str, outcome: str, reason: str, missing_ok: bool = False) -> bool:
    """End an upgrade (SUCCEEDED, FAILED, or REJECTED: its plan was not approved) and free the lock. False when it
    had ended already."""
    with session_scope(settings.database_url) as s:
        run = s.scalar(select(UpgradeRun).where(UpgradeRun.key == upgrade_key))
        if run is None and missing_ok:
            return False  # its preflight never got the lock
        if run is None:
            raise ChangeoverError(f"upgrade {upgrade_key!r}", "no such upgrade",
                                  "list them with `changeover upgrades`")
        if run.active is None:
            return False
        run.status, run.finished_at, run.active = outcome, utcnow(), None
        audit.record(s, "upgrade.end", "upgrade", upgrade_key,
                     outcome={"SUCCEEDED": "ok", "REJECTED": "rejected"}.get(outcome, "failed"), status=outcome,
                     reason=reason)
        return True


def status(settings: Settings, upgrade_key: str) -> str | None:
    """RUNNING, SUCCEEDED or FAILED; None for an upgrade that never began (its preflight did not get the lock)."""
    with session_scope(settings.database_url) as s:
        return s.scalar(select(UpgradeRun.status).where(UpgradeRun.key == upgrade_key))


def list_upgrades(settings: Settings) -> list[dict[str, Any]]:
    with session_scope(settings.database_url) as s:
        return [{"key": r.key, "target_version": r.target_version, "status": r.status, "actor": r.actor or "",
                 "started_at": r.started_at.isoformat(timespec="seconds"),
                 "phases": (r.progress or {}).get("phases", {})}
                for r in s.scalars(select(UpgradeRun).order_by(UpgradeRun.id))]
