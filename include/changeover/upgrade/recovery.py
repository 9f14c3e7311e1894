"""A failed or abandoned upgrade: see where it stopped, resume it, or abort it back to a clean state.

Abort gives every member of the upgrade back to service at the version its worker has, withdraws the stops
it asked for (a parked run resumes in place, an ended one continues from its checkpoint), and ends the
upgrade so its savepoints are no longer held. Jobs already moved stay where they are. Each step looks at
the actual state first, so abort can be run again after it was interrupted.
"""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import select

from changeover import audit, jobs
from changeover.cluster import Membership, get_member
from changeover.errors import ChangeoverError
from changeover.registry.db import lock_row, session_scope
from changeover.registry.models import Job, JobRun, Member, Savepoint, UpgradeRun
from changeover.registry.states import Desired, UpgradePhase
from changeover.settings import Settings
from changeover.upgrade import drain, lock, relocate, surges, verify

log = logging.getLogger(__name__)
STUCK = ("DRAINING", "DRAINED", "UPGRADING")


def status(settings: Settings, key: str) -> dict[str, Any]:
    """The upgrade's row, each of its members' phase and actual state, the stops pending and the held savepoints."""
    with session_scope(settings.database_url) as s:
        run = _get(s, key)
        progress = run.progress or {}
        names = list(progress.get("order") or run.members)
        members = {m.name: m for m in s.scalars(select(Member).where(Member.name.in_(names)))}
        stopping = list(s.scalars(select(Job.name).where(Job.desired == Desired.MOVE).order_by(Job.name)))
        held = [f"{sp.job}/{sp.name}" for sp in s.scalars(select(Savepoint).where(Savepoint.upgrade_key == key))]
        return {
            "key": run.key, "status": run.status, "target_version": run.target_version, "actor": run.actor,
            "locked": run.active is not None,
            "members": [{"name": name, "phase": progress.get("phases", {}).get(name, UpgradePhase.PENDING),
                         "status": members[name].status if name in members else "MISSING",
                         "version": members[name].version if name in members else None,
                         "reason": progress.get("reasons", {}).get(name)} for name in names],
            "jobs_asked_to_move": stopping,
            "savepoints": held if run.status == "RUNNING" else [],
        }


def abort(settings: Settings, cluster: Membership, key: str, reason: str = "aborted by hand") -> dict[str, Any]:
    """Members back in service, stops withdrawn, jobs running, the upgrade ended ABORTED (lock and savepoints
    released). A SUCCEEDED upgrade is refused: there is nothing to undo."""
    with session_scope(settings.database_url) as s:
        run = _get(s, key)
        if run.status == "SUCCEEDED":
            raise ChangeoverError(f"abort of upgrade {key}", "it succeeded, so there is nothing to undo",
                                  "to go back, run a new upgrade to the old version")
        names = list((run.progress or {}).get("order") or run.members)
    returned, member_problems = [], []
    for member in names:  # one member that cannot come back (its master away) does not keep the jobs from going on
        try:
            if _return_to_service(settings, cluster, member, f"abort of upgrade {key}: {reason}"):
                returned.append(member)
        except ChangeoverError as exc:
            member_problems.append(f"member {member} is not back in service: {exc}")
    resumed = _withdraw_moves(settings, cluster, f"abort of upgrade {key}")
    # surge members with jobs on them stay, serving: the abort's event names them
    surge_left = surges.release_idle(settings, cluster, key)
    cluster.stop_empty_masters()  # the target's, started for a member that is back at its old version
    # the jobs a failed restart or launch left down, and the members that did not come back
    down = [*verify.jobs_left_down(settings, cluster, key), *member_problems]
    if down:  # the upgrade keeps its lock and savepoints: the abort can be run again once the cause is mended
        with session_scope(settings.database_url) as s:
            audit.record(s, "upgrade.abort", "upgrade", key, outcome="failed", reason=reason,
                         members_returned=returned, jobs_resumed=resumed, problems=down)
        raise ChangeoverError(f"abort of upgrade {key}", "; ".join(down),
                              "mend the cause (see `changeover events`), then run `changeover upgrade abort` again "
                              "(a job still asked to move is relaunched) or `changeover submit CODE --name JOB` (an "
                              "ended job goes on from its checkpoint); its savepoint stays held until then")
    with session_scope(settings.database_url) as s:
        run = lock_row(s, UpgradeRun, _get(s, key).id)
        was = run.status
        if run.active is not None or run.status == "FAILED":
            run.status, run.active = "ABORTED", None
        audit.record(s, "upgrade.abort", "upgrade", key, was=was, reason=reason, members_returned=returned,
                     jobs_resumed=resumed, **({"surge_members_left": surge_left} if surge_left else {}))
    return status(settings, key)


def resume(settings: Settings, key: str) -> None:
    """Take the lock again for an upgrade that FAILED, so that clearing its Airflow run's failed tasks goes on
    from where it stopped: its members' phases are kept."""
    with session_scope(settings.database_url) as s:
        run = _get(s, key)
        if run.active is not None:
            return
        if run.status != "FAILED":
            raise ChangeoverError(f"resume of upgrade {key}", f"it ended as {run.status}",
                                  "only a FAILED upgrade can be resumed; trigger a new run of the DAG instead")
        holder = s.scalar(select(UpgradeRun).where(UpgradeRun.active.is_not(None)))
        if holder is not None:
            raise lock.busy(key, holder)
        run = lock_row(s, UpgradeRun, run.id)
        run.status, run.active, run.finished_at = "RUNNING", 1, None
        audit.record(s, "upgrade.resume", "upgrade", key)


def _return_to_service(settings: Settings, cluster: Membership, member: str, reason: str) -> bool:
    with session_scope(settings.database_url) as s:
        row = s.get(Member, member)
        if row is None or row.status not in STUCK:
            return False
        state, version = row.status, row.version
    if state == "DRAINING":
        return drain.abort(settings, cluster, member, reason)
    began = drain.drain_began(settings, member)  # before a worker's restart clears the row's mark
    if cluster.is_decommissioned(member):  # drained, or its worker gone: a fresh one at the version it has
        restart = drain.recommission(settings, cluster, member, reason)
    else:  # half restarted: only when nothing runs there, since its drivers may be new ones the master placed
        restart = not jobs.drivers_on(settings, cluster, member)
        if restart:
            cluster.stop_worker(member)
            cluster.start_worker(member, version)
    continued = jobs.continue_ended_on(settings, cluster, member, began)  # also after an abort that died midway
    with session_scope(settings.database_url) as s:
        row = get_member(s, member)
        row.status, row.drain_started_at = "ACTIVE", None
        audit.record(s, "member.return", "member", member, was=state, version=version, reason=reason,
                     worker_restarted=restart, still_decommissioned=not restart, jobs_continued=continued)
    return True


def _withdraw_moves(settings: Settings, cluster: Membership, reason: str) -> list[str]:
    """Jobs still asked to move run again where they are: a parked run resumes, an ended one continues."""
    with session_scope(settings.database_url) as s:
        moving = list(s.scalars(select(Job.name).where(Job.desired == Desired.MOVE)))
        standing = list(s.scalars(select(JobRun.id).where(JobRun.standby_of.is_not(None),
                                                          JobRun.ended_at.is_(None))))
    for standby in standing:  # warm moves not yet asked to stop: the job still runs where it was
        jobs.dismiss_standby(settings, cluster, standby, f"the upgrade was aborted: {reason}")
    withdrawn = []
    for name in moving:
        try:
            relocate.withdraw(settings, cluster, name, reason)
        except ChangeoverError as exc:  # one job's failed launch does not keep the others down; the check names it
            log.warning("job %s: its move was not withdrawn: %s", name, exc)
            continue
        withdrawn.append(name)
    return withdrawn


def _get(s: Any, key: str) -> UpgradeRun:
    run = s.scalar(select(UpgradeRun).where(UpgradeRun.key == key))
    if run is None:
        known = ", ".join(s.scalars(select(UpgradeRun.key).order_by(UpgradeRun.id.desc()).limit(5))) or "none"
        raise ChangeoverError(f"upgrade {key!r}", f"no such upgrade (latest: {known})",
                              "list them with `changeover upgrades`")
    return run
