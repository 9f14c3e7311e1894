"""Graceful drain of a member, after Jet's rolling-upgrade shutdown rules.

Fault-tolerant jobs are stopped with a savepoint at once and resumed elsewhere; block_shutdown
jobs are waited for until they finish; any other job is waited for up to its shutdown_timeout,
then cancelled. The worker is decommissioned once the fault-tolerant jobs on it have reached a
batch boundary: decommissioning first would take away the executors a batch needs to finish when
the member is the last of its version group. `plan` observes and `decide` (`drain_plan`), a pure function, makes
the plan of what it saw; `step` acts on that plan, in small idempotent steps.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import func, or_, select

from changeover import audit, faults, jobs, light
from changeover.cluster import Membership, get_member
from changeover.errors import ChangeoverError, NeedsOperator
from changeover.light import ledger
from changeover.registry.db import lock_all, session_scope
from changeover.registry.models import STOPPING, Event, Job, JobRun, LightJob, Member, utcnow
from changeover.registry.states import Desired, MemberStatus, RunState
from changeover.settings import Settings
from changeover.timeutil import as_utc
from changeover.upgrade import placement, relocate, warm, zero_downtime
from changeover.upgrade.drain_plan import DrainPlan, JobObservation, Observation, decide

BUSY = ("DRAINING", "DRAINED", "UPGRADING")


def jobs_on(settings: Settings, membership: Membership, member: str, since: datetime | None = None
            ) -> list[tuple[Job, JobRun]]:
    """Jobs whose current run is on `member`. Only runs the registry places there, or not yet anywhere, are
    asked about: a driver never changes worker, so a drain poll costs the member's jobs, not the fleet's."""
    with session_scope(settings.database_url) as s:
        candidates = list(s.execute(select(Job, JobRun.id).join(JobRun, JobRun.id == Job.current_run_id)
                                    .where(or_(JobRun.member == member, JobRun.member.is_(None)))
                                    .order_by(Job.name)))
    found = []
    for job, run_id in candidates:
        run = jobs.observe(settings, membership, run_id)
        if run.member != member:
            continue
        # A job asked to move is ours to save and resume until it runs elsewhere: stopped at a boundary, or
        # ended on the way there (its driver killed, its worker lost), never left behind.
        if run.state in jobs.LIVE or job.desired == Desired.MOVE or _killed_since(job, run, since):
            found.append((job, run))
    return found


FIRST_BATCH_WAIT_SECONDS = 60.0


def _first_batch_pending(settings: Settings, member: str, since: datetime | None) -> list[str]:
    """Jobs moved off the member in this drain whose new run has not yet finished its first trigger, for up to
    FIRST_BATCH_WAIT_SECONDS after their old run ended: the member's restart (a JVM start) waits for them, so it
    does not compete for the cores with their first batch on the new version, which is the move's downtime. A
    first trigger that finds no new input ends the wait as a commit does; the bound is for a run that never gets
    that far."""
    if since is None:
        return []
    recent = max(as_utc(since), utcnow() - timedelta(seconds=FIRST_BATCH_WAIT_SECONDS))
    with session_scope(settings.database_url) as s:
        left = select(JobRun.job).where(JobRun.member == member, JobRun.ended_at >= recent)
        return list(s.scalars(select(Job.name).join(JobRun, JobRun.id == Job.current_run_id).where(
            Job.name.in_(left), JobRun.first_commit_at.is_(None), JobRun.first_trigger_at.is_(None),
            JobRun.ended_at.is_(None), or_(JobRun.member.is_(None), JobRun.member != member))))


def _killed_since(job: Job, run: JobRun, since: datetime | None) -> bool:
    """A fault-tolerant job still wanted whose run died during the drain before it was asked to stop (while its
    standby warmed, say): the drain moves it from its checkpoint, as one killed on its way to the move."""
    return (since is not None and job.fault_tolerant and job.desired == Desired.RUN and run.state == RunState.KILLED
            and run.ended_at is not None and as_utc(run.ended_at) >= as_utc(since))


def plan(settings: Settings, membership: Membership, member: str, shutdown_timeout: int | None = None,
         upgrade_key: str | None = None) -> DrainPlan:
    """What draining `member` waits for now: observed, then `decide`d. shutdown_timeout caps each job's own;
    upgrade_key: the upgrade whose catch-up a zero-downtime move's follower is given."""
    with session_scope(settings.database_url) as s:
        row = get_member(s, member)
        status, started = row.status, row.drain_started_at
        others = s.scalars(select(Member.name).where(Member.name != member, Member.status.in_(BUSY))).all()
    seen = Observation(member, status, tuple(others), shutdown_cap=shutdown_timeout)
    if status in ("DRAINED", "UPGRADING", "STOPPED") or (status == "ACTIVE" and others):
        return decide(seen)
    now = utcnow()
    draining = status == "DRAINING"
    found, catch_up = [], None
    for job, run in jobs_on(settings, membership, member, started if draining else None):
        live = run.state in jobs.LIVE
        asked = job.desired in STOPPING
        waiting = False
        if job.fault_tolerant and live and not asked:
            catch_up = catch_up or zero_downtime.for_upgrade(settings, upgrade_key)[1]
            waiting = zero_downtime.waiting_on_successor(settings, membership, run, catch_up)
        found.append(JobObservation(job.name, job.fault_tolerant, job.block_shutdown, job.shutdown_timeout, live,
                                    asked, waiting))
    found += [JobObservation(job.tag, False, job.block_shutdown, job.shutdown_timeout, True, False, light=True)
              for job in light_jobs_on(settings, membership, member)]
    seen = replace(seen, jobs=tuple(found), draining_for=(now - as_utc(started)).total_seconds() if started else 0.0)
    if not draining:
        return decide(seen)
    seen = replace(seen, decommissioned=membership.is_decommissioned(member), moving_off=frozenset(
        {run.job for run in jobs.parked_runs_on(settings, membership, member)}
        | set(_first_batch_pending(settings, member, started))))
    result = decide(seen)
    if result.decommissioned and not result.jobs_left:  # only then are its executors looked at
        count = membership.executors_on(member)
        grace = _executor_grace_left(settings, member, started, shutdown_timeout, now) if count else 0.0
        result = decide(replace(seen, executors=count, executor_grace_left=grace))
    return result


EXECUTOR_GRACE_SECONDS = 30


def _executor_grace_left(settings: Settings, member: str, since: datetime | None, shutdown_timeout: int | None,
                         now: datetime) -> float:
    """Seconds the member's restart still waits for executors of other members' drivers to leave its decommissioned
    worker. They leave once idle, but Spark misses one that registers with its driver just after the decommission
    (the master had placed it a moment before): it would run tasks there for as long as its application lives.
    Past the grace, the restart ends it and its driver reruns its tasks elsewhere; nothing is lost."""
    with session_scope(settings.database_url) as s:
        decommissioned = s.scalar(select(func.max(Event.at)).where(
            Event.action == "member.decommission", Event.subject == member,
            *([Event.at >= since] if since else [])))
    begun = as_utc(decommissioned or since or now)
    grace = shutdown_timeout if shutdown_timeout is not None else EXECUTOR_GRACE_SECONDS
    return grace - (now - begun).total_seconds()


def step(
    settings: Settings,
    membership: Membership,
    member: str,
    shutdown_timeout: int | None = None,
    upgrade_key: str | None = None,
) -> DrainPlan:
    current = plan(settings, membership, member, shutdown_timeout, upgrade_key)
    if current.done or current.blocked_by:
        return current
    if current.status == "ACTIVE" and not _begin(settings, current):
        return current  # another member's drain began first
    _refuse_failed_moves(settings, current, upgrade_key)
    if current.save:
        _move(settings, membership, member, current.save, upgrade_key)
    for name in current.cancel:
        reason = f"drain of {member}: shutdown_timeout ran out"
        if name in current.light:
            light.interrupt(settings, name, reason)
        else:
            jobs.cancel(settings, membership, name, reason=reason)
        _record(settings, "drain.cancelled", member, name)
    after = plan(settings, membership, member, shutdown_timeout, upgrade_key)
    if after.status == "DRAINING" and not after.light:
        membership.stop_connect(member)  # no light job left on it, and none is routed to a DRAINING member
    if after.status == "DRAINING" and not (after.save or after.warming or after.stopping or after.decommissioned):
        membership.decommission(member)  # only now: the saved jobs' batches no longer need its executors
        after = plan(settings, membership, member, shutdown_timeout, upgrade_key)
    if after.decommissioned and after.stopped:  # decommissioned first, so a resumed driver cannot land here
        faults.point(settings, "drain.after_stop")
        _move(settings, membership, member, after.stopped, upgrade_key)
        after = plan(settings, membership, member, shutdown_timeout, upgrade_key)
    if current.status != "ACTIVE" and after.decommissioned and after.executors == 0 and not after.jobs_left:
        with session_scope(settings.database_url) as s:
            row = s.get(Member, member)
            assert row is not None
            waited = (utcnow() - as_utc(row.drain_started_at)).total_seconds() if row.drain_started_at else 0.0
            row.status = MemberStatus.DRAINED
            audit.record(s, "drain.complete", "member", member, seconds=round(waited, 1),
                         **({"executors_left": after.executors_left} if after.executors_left else {}))
        after.status = "DRAINED"
    return after


def light_jobs_on(settings: Settings, membership: Membership, member: str) -> list[LightJob]:
    """Light jobs running on the member's Connect server. Rows whose server or client is gone are ended (what may be
    left of them on the server interrupted): nothing waits for their results, and a drain must not wait for them."""
    alive = []
    for job, why in ledger.gone(settings, ledger.running_on(settings, member), membership.connect_running):
        if why is None:
            alive.append(job)
        else:
            light.interrupt(settings, job.tag, why, settle=0)
    return alive


def _move(settings: Settings, membership: Membership, member: str, names: list[str], upgrade_key: str | None) -> None:
    """The next step of each job's move (`relocate.step`): one job that cannot move does not hold back the others."""
    targets = destinations(settings, membership, names, upgrade_key)
    strategy, catch_up = zero_downtime.for_upgrade(settings, upgrade_key)
    refused: list[ChangeoverError] = []
    for name in names:
        try:
            if relocate.step(settings, membership, name, targets[name], reason=f"drain-{member}",
                             avoid_member=member, upgrade_key=upgrade_key, strategy=strategy, catch_up=catch_up):
                _record(settings, "drain.saved", member, name, resumed_on=targets[name])
        except ChangeoverError as exc:
            refused.append(exc)
    if refused:
        raise ChangeoverError(f"drain of member {member}", "; ".join(str(e) for e in refused),
                              "fix or resume those jobs as said, then retry the task")


def destinations(settings: Settings, membership: Membership, names: list[str],
                 upgrade_key: str | None) -> dict[str, str]:
    """Where each job leaving the member goes. A job whose standby already waits on the upgrade's final group keeps
    that group: the standby's own cores must not make it look full, which would dismiss the standby and send the job
    to the old version, cold, to move again later."""
    exclude = _not_serving(settings)
    target = placement.upgrade_destination(settings, exclude, upgrade_key, membership)
    final = placement.upgrade_destination(settings, exclude, upgrade_key)  # the same, its free cores aside
    if final == target:
        return dict.fromkeys(names, target)
    return {name: final if _standby_version(settings, membership, name) == final else target for name in names}


def _standby_version(settings: Settings, membership: Membership, job_name: str) -> str | None:
    """The version of the job's standby once it holds its cores there (placed by its master, or ready); a standby
    still queued holds none, and the group it waits on is as full as it looks."""
    with session_scope(settings.database_url) as s:
        run_id = jobs.get_job(s, job_name).current_run_id
    standby = warm.standby_of(settings, membership, run_id) if run_id is not None else None
    if standby is None or (standby.member is None and standby.ready_at is None):
        return None
    return standby.spark_version


def _begin(settings: Settings, current: DrainPlan) -> bool:
    """Mark the member DRAINING, unless another member's drain began meanwhile: the members' rows are locked
    (FOR UPDATE on PostgreSQL, the write lock on SQLite) so two drains cannot both see the others idle."""
    with session_scope(settings.database_url) as s:
        rows = lock_all(s, Member)
        row = next(r for r in rows if r.name == current.member)
        current.blocked_by = [r.name for r in rows if r.name != current.member and r.status in BUSY]
        if current.blocked_by or row.status != MemberStatus.ACTIVE:
            return False
        row.status, row.drain_started_at = "DRAINING", utcnow()
        saved = [*current.save, *current.warming, *current.stopping, *current.stopped]
        decisions = {**{j: "save" for j in saved}, **{j: "wait" for j in current.wait},
                     **{j: "timeout" for j in [*current.grace, *current.cancel]}}
        audit.record(s, "drain.begin", "member", current.member, decisions=decisions)
        for job, action in decisions.items():
            audit.record(s, f"drain.decide.{action}", "job", job, member=current.member)
    current.status = "DRAINING"
    return True


def drain_began(settings: Settings, member: str) -> datetime | None:
    """When the member's last drain began: its row's mark, or, once a worker's restart has cleared that (an abort
    that died midway and is run again), its last `drain.begin` event."""
    with session_scope(settings.database_url) as s:
        marked = get_member(s, member).drain_started_at
        return marked or s.scalar(select(func.max(Event.at)).where(Event.action == "drain.begin",
                                                                   Event.subject == member))


def recommission(settings: Settings, membership: Membership, member: str, reason: str) -> bool:
    """A decommissioned worker gets no new executors until it restarts, so drivers left on it starve. Restart it at
    its version, unless a driver on it cannot come back: the fault-tolerant jobs' current runs are ended first and
    go on from their checkpoints after the restart (on the same version); any other driver is never killed, and
    then the worker is left as it is. True once restarted; safe to repeat."""
    drivers = jobs.drivers_on(settings, membership, member)
    with session_scope(settings.database_url) as s:
        version = get_member(s, member).version
        movable = set(s.scalars(select(Job.current_run_id).where(  # only these drivers' jobs, not the fleet's
            Job.fault_tolerant.is_(True), Job.current_run_id.in_([run.id for run in drivers]))))
    standbys = [run for run in drivers if run.id not in movable and run.standby_of is not None]
    drivers = [run for run in drivers if run not in standbys]
    if any(run.id not in movable for run in drivers):
        return False
    # a warm successor not yet handed its job would starve there too: its move starts again; one handed its job
    # meanwhile is now the job's run, and a second look ends it for the restart like the others
    dismissed = [jobs.dismiss_standby(settings, membership, run.id, f"{reason}: its member's worker is restarted")
                 for run in standbys]
    if not all(dismissed):
        return recommission(settings, membership, member, reason)
    for run in drivers:
        jobs.end_for_restart(settings, membership, run.id, f"{reason}: its member's worker is restarted, since a "
                             "decommissioned worker gets no executors; it goes on from its checkpoint")
    membership.stop_worker(member)
    membership.start_worker(member, version)
    with session_scope(settings.database_url) as s:
        audit.record(s, "member.recommission", "member", member, version=version, reason=reason,
                     jobs_ended=[run.job for run in drivers])
    return True


def _refuse_failed_moves(settings: Settings, current: DrainPlan, upgrade_key: str | None) -> None:
    """A job whose moves in this drain ended before writing (its own code failed where it went, or too many tries
    died) was handed back to its parked run each time: asking it to stop again would only fail again, so the drain
    stops here for a person to decide. Nothing is lost: the job is on its old run, at the batch it parked on."""
    with session_scope(settings.database_url) as s:
        began = get_member(s, current.member).drain_started_at
    if began is None:
        return
    failed = [(name, tries) for name in current.save if (tries := relocate.failed_tries(settings, name, began))]
    if not failed:
        return
    what = "; ".join(f"job {name}'s run {tries[0].id} on Spark {tries[0].spark_version} ended {tries[0].state} "
                     f"before writing anything ({tries[0].error or 'no reason recorded'}; {len(tries)} such tries "
                     "in this drain)" for name, tries in failed)
    undo = (f"`changeover upgrade abort {upgrade_key}`" if upgrade_key
            else f"`changeover drain {current.member} --abort`")
    with session_scope(settings.database_url) as s:
        for name, tries in failed:
            audit.record(s, "drain.refused", "job", name, member=current.member, outcome="failed", run=tries[0].id,
                         version=tries[0].spark_version, state=tries[0].state, error=tries[0].error, tries=len(tries))
    raise NeedsOperator(f"drain of member {current.member}",
                        f"{what}. Each job was handed back to its old run at the batch it parked on, so nothing was "
                        "lost; on a decommissioned member it gets no executors until the member is given back",
                        f"give the members back with {undo}, which runs the job on at its old version; to upgrade it "
                        "later, update its code for the new version first (the update_job DAG)")


def _not_serving(settings: Settings) -> list[str]:
    with session_scope(settings.database_url) as s:
        return list(s.scalars(select(Member.name).where(Member.status != MemberStatus.ACTIVE)))


def _record(settings: Settings, action: str, member: str, job: str, **details: Any) -> None:
    with session_scope(settings.database_url) as s:
        audit.record(s, action, "job", job, member=member, **details)


def abort(settings: Settings, membership: Membership, member: str, reason: str) -> bool:
    """Give a member back to service mid-drain (its drain window closed). True once it is ACTIVE again.

    Stops still pending are withdrawn, so parked runs resume in place; jobs already moved stay moved. A
    decommissioned worker takes no new work until it restarts, so it is restarted at its version (`recommission`):
    fault-tolerant jobs' drivers on it go on from their checkpoints, and any other running job is never killed to
    end a drain (the worker is then left as it is).
    """
    current = plan(settings, membership, member)
    if current.status not in ("ACTIVE", "DRAINING"):
        return False  # already drained: finishing the upgrade is quicker than undoing it
    for name in [*current.save, *current.warming, *current.stopping, *current.stopped]:
        relocate.withdraw(settings, membership, name, reason, member=member)
    began = drain_began(settings, member)
    restart = current.decommissioned and recommission(settings, membership, member, reason)
    # also after an abort that died between the restart and here: what is looked at is the jobs' runs
    continued = jobs.continue_ended_on(settings, membership, member, began)
    with session_scope(settings.database_url) as s:
        row = get_member(s, member)
        row.status, row.drain_started_at = "ACTIVE", None
        serves_light_jobs = row.light_jobs
        audit.record(s, "drain.abort", "member", member, reason=reason, worker_restarted=restart,
                     jobs_continued=continued, still_decommissioned=current.decommissioned and not restart)
    if serves_light_jobs:
        membership.start_connect(member)  # the drain stopped it; back in service, it serves light jobs again
    return True
