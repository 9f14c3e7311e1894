"""A rolling upgrade as one sequence: members in order, one at a time, each drained then upgraded.

The sequence's progress lives in the upgrade's registry row (member -> phase), so a resumed, retried or
spuriously re-run task continues where it was: a member UPGRADED is never drained again, and the next
member's drain starts only once the previous member is back in service at the target version. One
caller advances it at a time; nothing waits while holding what another member needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from changeover import audit
from changeover.cluster import Membership
from changeover.errors import ChangeoverError
from changeover.registry.db import lock_row, session_scope
from changeover.registry.models import Member, UpgradeRun, utcnow
from changeover.registry.states import MemberStatus, UpgradePhase
from changeover.settings import Settings
from changeover.upgrade import drain, lock, maintenance, member_upgrade, surges, zero_downtime
from changeover.upgrade.windows import DrainWindow, may_start_drain

PENDING, DRAINING, UPGRADED, SKIPPED = UpgradePhase.PENDING, UpgradePhase.DRAINING, UpgradePhase.UPGRADED, \
    UpgradePhase.SKIPPED


@dataclass
class RollStatus:
    upgrade: str
    phases: dict[str, str]
    current: str | None = None  # the member being drained, when the roll waits on it
    drain: drain.DrainPlan | None = None
    reasons: dict[str, str] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.current is None

    def as_dict(self) -> dict[str, Any]:
        return {"upgrade": self.upgrade, "phases": self.phases, "current": self.current, "reasons": self.reasons,
                "drain": self.drain.as_dict() if self.drain else None}


def start(settings: Settings, upgrade_key: str, members: list[str], live_jobs: list[str] | None = None) -> list[str]:
    """Record the order once, and the fault-tolerant jobs running as it begins (verify expects each of them
    running after it); a retried preflight keeps the progress already made. Returns the order kept."""
    with session_scope(settings.database_url) as s:
        run = lock.started(s, upgrade_key)
        if not run.progress:
            run.progress = {"order": list(members), "phases": dict.fromkeys(members, PENDING), "reasons": {},
                            "jobs": list(live_jobs or [])}
        return list(run.progress["order"])


def step(
    settings: Settings,
    cluster: Membership,
    upgrade_key: str,
    shutdown_timeout: int | None = None,
    window: DrainWindow | None = None,
    drain_needs_seconds: float = 0.0,
    now: datetime | None = None,
    surge: int = 0,
    move_strategy: str | None = None,
    catch_up: zero_downtime.CatchUp | None = None,
) -> RollStatus:
    """Advance the roll as far as it goes without waiting. Returns what it waits on, or done. With surge, that
    many temporary members join at the target version before the first drain, so capacity never drops below
    what the fleet had, and leave once every member is upgraded. move_strategy: how its drains move jobs
    (`relocate.step`), recorded with the upgrade by its first try."""
    lock.require_active(settings, upgrade_key)
    with session_scope(settings.database_url) as s:
        run = lock.started(s, upgrade_key)
        target, order = run.target_version, list((run.progress or {}).get("order", []))
    zero_downtime.record_for_upgrade(settings, upgrade_key, move_strategy, catch_up or zero_downtime.CatchUp())
    if surge:
        surges.add(settings, cluster, upgrade_key, target, surge)
    for member in order:
        phase = _phase(settings, upgrade_key, member)
        if phase in (UPGRADED, SKIPPED):
            continue
        if _settled_without_drain(settings, upgrade_key, member, phase, target):
            continue
        if window is not None:
            moment = now or utcnow()
            allowed, reason = may_start_drain(window, moment, drain_needs_seconds if phase == PENDING else 0.0)
            if not allowed and (phase == PENDING or drain.abort(settings, cluster, member, reason)):
                _set_phase(settings, upgrade_key, member, SKIPPED, reason)
                continue
        if phase == PENDING:
            cluster.ensure_master(target)  # while the member drains, not inside its restart
            _set_phase(settings, upgrade_key, member, DRAINING)
        plan = drain.step(settings, cluster, member, shutdown_timeout, upgrade_key=upgrade_key)
        outside = [m for m in plan.blocked_by if m not in order]
        if outside:  # a drain begun by hand: waiting would hold the upgrade until someone finishes it
            raise ChangeoverError(f"drain of member {member} for upgrade {upgrade_key}",
                                  f"member {', '.join(outside)} is being drained or upgraded outside this upgrade",
                                  f"finish it (`changeover upgrade member {outside[0]} --to VERSION`), then clear "
                                  "this task to retry")
        if not plan.done:
            return _status(settings, upgrade_key, member, plan)
        member_upgrade.upgrade_member(settings, cluster, member, target)
        _upgraded(settings, upgrade_key, member, target)
    leaving, plan = surges.remove(settings, cluster, upgrade_key, shutdown_timeout)
    return _status(settings, upgrade_key, leaving, plan)


def _settled_without_drain(settings: Settings, upgrade_key: str, member: str, phase: str, target: str) -> bool:
    """Whether the member needs no drain, its phase recorded: it is at the target already, or someone stopped it
    before the roll reached it."""
    with session_scope(settings.database_url) as s:
        row = s.get(Member, member)
        at_target = row is not None and row.version == target and row.status == MemberStatus.ACTIVE
    if at_target:  # upgraded by an attempt that died before it recorded so
        _upgraded(settings, upgrade_key, member, target)
        return True
    if row is not None and row.status == "STOPPED" and phase == PENDING:
        # someone stopped its worker: starting it at the target would undo their stop
        _set_phase(settings, upgrade_key, member, SKIPPED, f"member {member} is stopped; start it with "
                   f"`changeover cluster up --members {member} --version {row.version}` and run the upgrade "
                   "again to include it")
        return True
    return False


def observe(
    settings: Settings, cluster: Membership, upgrade_key: str, shutdown_timeout: int | None = None
) -> RollStatus:
    """Read-only: what the roll waits on now (for a trigger)."""
    with session_scope(settings.database_url) as s:
        progress = lock.started(s, upgrade_key).progress or {}
    current = next((m for m in progress.get("order", []) if progress["phases"][m] == DRAINING), None) \
        or surges.leaving(progress)
    plan = drain.plan(settings, cluster, current, shutdown_timeout, upgrade_key) if current else None
    return _status(settings, upgrade_key, current, plan)


def _status(settings: Settings, key: str, current: str | None, plan: drain.DrainPlan | None) -> RollStatus:
    with session_scope(settings.database_url) as s:
        progress = lock.started(s, key).progress or {}
    return RollStatus(key, dict(progress.get("phases", {})), current, plan, dict(progress.get("reasons", {})))


def _phase(settings: Settings, key: str, member: str) -> str:
    with session_scope(settings.database_url) as s:
        return str((lock.started(s, key).progress or {}).get("phases", {}).get(member, PENDING))


def _upgraded(settings: Settings, key: str, member: str, target: str) -> None:
    _set_phase(settings, key, member, UPGRADED)
    maintenance.unmark(settings, member, f"upgraded to {target} by {key}")


def _set_phase(settings: Settings, key: str, member: str, phase: str, reason: str | None = None) -> None:
    with session_scope(settings.database_url) as s:
        run = lock_row(s, UpgradeRun, lock.started(s, key).id)
        progress = dict(run.progress or {})
        before = progress.get("phases", {}).get(member)
        if before == phase:
            return
        progress["phases"] = {**progress.get("phases", {}), member: phase}
        if reason:
            progress["reasons"] = {**progress.get("reasons", {}), member: reason}
        run.progress = progress  # a new dict, so the JSON column is written
        audit.record(s, f"upgrade.member.{phase.lower()}", "member", member, upgrade=key, before=before,
                     **({"reason": reason} if reason else {}))
