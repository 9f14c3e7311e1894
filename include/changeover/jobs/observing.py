"""Observing a job's runs: each run's driver as its master reports it, recorded (`observe`, `refresh`), the runs on a
member, and the jobs as `changeover jobs` lists them.

None of `observe`, `refresh`, `refresh_all` (nor what calls them: `parked_runs_on`, `drivers_on`,
`wait_until_committed`) is read-only: each records what the master says in the run's row (its state, member, error
and end) and an ended run's `job.end` in the audit."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from sqlalchemy import select, update

from changeover import audit
from changeover.cluster import Membership, NoMaster, wait_for
from changeover.cluster.spark_master import DriverStatus, MasterUnreachable
from changeover.handoff import lease
from changeover.jobs.launching import LAYING_OUT
from changeover.registry.db import session_scope
from changeover.registry.models import Job, JobRun, Member, utcnow
from changeover.registry.records import LIVE, STANDBY, current_run, get_job
from changeover.registry.states import PARKED_FORMS, RunState
from changeover.runtime import checkpoints
from changeover.settings import Settings
from changeover.timeutil import as_utc

log = logging.getLogger("changeover.jobs")


# ERROR is Spark's word for a driver whose worker was lost (or that could not be started): not the job's own
# failure, so a fault-tolerant job goes on from its checkpoint, as after a kill.
DRIVER_STATES = {"RUNNING": "RUNNING", "FINISHED": "FINISHED", "FAILED": "FAILED", "ERROR": "KILLED",
                 "KILLED": "KILLED"}


def refresh(settings: Settings, membership: Membership, job_name: str) -> JobRun | None:
    """Observe the current run's driver through its master and record what it says (`observe`: it writes)."""
    with session_scope(settings.database_url) as s:
        run = current_run(s, get_job(s, job_name))
        if run is None:
            return None
        run_id = run.id
    return observe(settings, membership, run_id)


def observe(settings: Settings, membership: Membership, run_id: int) -> JobRun:
    """Ask the run's master about its driver, and record what it says.

    Only the master's word ends a run, or a silence past `lost_after_seconds` from both the master and the
    driver's heartbeat: a master that is slow to answer says nothing about its drivers, so one unanswered
    query leaves the run as it was (observed UNKNOWN) and the next observation asks again.
    """
    with session_scope(settings.database_url) as s:
        run = s.get(JobRun, run_id)
        assert run is not None
        if run.submission_id is None and run.state == RunState.SUBMITTED and run.heartbeat_at is None:
            _unaccepted(s, run)
        if run.submission_id is None or not (run.state in (*LIVE, STANDBY) or run.parked):
            return run
        version, submission = run.spark_version, run.submission_id
    status, unanswered = _driver_status(membership, version, submission)
    with session_scope(settings.database_url) as s:
        run = s.get(JobRun, run_id)
        assert run is not None
        if status is not None and status.worker_host:
            run.member = s.scalar(select(Member.name).where(Member.host == status.worker_host))
        observed = DRIVER_STATES.get(status.state) if status else (None if unanswered else "KILLED")
        if status is not None and status.state == "ERROR" and not run.error:
            run.error = "its master reports ERROR: its worker was lost, or the driver could not be started"
        if observed == "FAILED" and run.state in (*LIVE, STANDBY) and not run.error:
            # The driver records its own failures before it exits; one that ended FAILED without a word was
            # killed or crashed (kill -9, the OOM killer), so its checkpoint is as whole as after a kill.
            observed = "KILLED"
            run.error = checkpoints.read_gave_up(run.checkpoint_root) or (  # a driver that stood down, then gave up
                "its driver ended without reporting a failure of its own: killed, or its process crashed")
        if status is not None and status.state in ("SUBMITTED", "RELAUNCHING"):
            return run  # queued for cores, or being relaunched: alive in its master's word, however long it waits
        if observed is None:  # no word either way
            if run.parked:
                return run  # a parked driver ends itself, so only its master's word ends it here
            silent = (utcnow() - as_utc(run.heartbeat_at or run.submitted_at)).total_seconds()
            if silent < lease.lost_after_seconds():
                log.info("job %s run %s: state UNKNOWN (%s); asked again at the next observation", run.job,
                         run.id, unanswered or f"its master reports the driver as {status and status.state}")
                return run
            observed = "KILLED"
            run.error = f"lost: no word from its master ({unanswered or 'driver unknown'}) and no heartbeat " \
                        f"for {silent:.0f} s"
        if observed != "RUNNING" and run.parked:
            # its driver is gone; the checkpoint still ends on the batch boundary it parked at
            run.state, run.ended_at = RunState.STOPPED, utcnow()
            run.error = run.error or checkpoints.read_gave_up(run.checkpoint_root)  # a driver that gave up says why
            audit.record(s, "job.end", "job", run.job, run=run.id, state=RunState.STOPPED, driver=observed,
                         **({"reason": run.error} if run.error else {}))
        elif observed != "RUNNING" and run.state in (*LIVE, STANDBY):
            run.state, run.ended_at = observed, run.ended_at or utcnow()
            audit.record(s, "job.end", "job", run.job, run=run.id, state=observed,
                         **({"reason": run.error} if run.error else {}))
        elif observed == "RUNNING" and run.state == RunState.SUBMITTED and run.heartbeat_at is not None:
            run.state = RunState.RUNNING
        return run


def _driver_status(membership: Membership, version: str, submission: str) -> tuple[DriverStatus | None, str | None]:
    """What the run's master says of its driver, and why it said nothing when it did not answer."""
    unanswered: str | None = None
    try:
        status: DriverStatus | None = membership.master(version).status(submission)
    except MasterUnreachable as exc:
        status, unanswered = None, exc.reason
    except NoMaster:
        status = None  # its group's master was stopped, and its drivers with it
    return status, unanswered


def _unaccepted(s: Any, run: JobRun) -> None:
    """A run its launch created but whose driver was never heard of: its task died before the master answered,
    or the master never took it. Ended once that silence outlasts `lost_after_seconds`, so the parked run it
    would replace takes the job back; a driver that does start that late finds its run ended and exits."""
    silent = (utcnow() - as_utc(run.submitted_at)).total_seconds()
    laying_out = run.checkpoint_root and (Path(run.checkpoint_root) / LAYING_OUT).exists()
    if silent < lease.lost_after_seconds() or laying_out:
        return  # not yet silent long, or its launch still lays out its checkpoint (a large state copies slowly)
    error = f"never accepted: no submission id and no word from its driver for {silent:.0f} s"
    # Conditional, so a driver's first heartbeat and this cannot both win: the row lock orders them.
    ended = s.execute(update(JobRun).where(
        JobRun.id == run.id, JobRun.submission_id.is_(None), JobRun.heartbeat_at.is_(None), JobRun.ended_at.is_(None)
    ).values(state="KILLED", ended_at=utcnow(), error=error).execution_options(synchronize_session=False)).rowcount
    s.refresh(run)
    if ended:
        audit.record(s, "job.end", "job", run.job, run=run.id, state="KILLED", reason=error)


def parked_runs_on(settings: Settings, membership: Membership, member: str) -> list[JobRun]:
    """Runs parked on a member whose drivers still live: they exit once their successors write."""
    with session_scope(settings.database_url) as s:
        ids = list(s.scalars(select(JobRun.id).where(
            JobRun.member == member, JobRun.state.in_(PARKED_FORMS), JobRun.ended_at.is_(None))))
    return [run for run in (observe(settings, membership, i) for i in ids) if run.parked]


def drivers_on(settings: Settings, membership: Membership, member: str) -> list[JobRun]:
    """Runs whose drivers still live on a member, running or parked: the one query a restart of its worker must
    ask, since a parked run may resume between two narrower looks."""
    with session_scope(settings.database_url) as s:
        ids = list(s.scalars(select(JobRun.id).where(JobRun.member == member, JobRun.ended_at.is_(None))))
    return [run for run in (observe(settings, membership, i) for i in ids) if run.ended_at is None]


def refresh_all(
    settings: Settings, membership: Membership, fault_tolerant_only: bool = False
) -> list[tuple[Job, JobRun | None]]:
    """Every job (or every fault-tolerant one) with its freshly observed current run, each recorded (`refresh`)."""
    with session_scope(settings.database_url) as s:
        query = select(Job).order_by(Job.name)
        if fault_tolerant_only:
            query = query.where(Job.fault_tolerant.is_(True))
        listed = list(s.scalars(query))
    return [(job, refresh(settings, membership, job.name)) for job in listed]


def wait_until_committed(settings: Settings, membership: Membership, job_name: str, timeout: float = 240) -> JobRun:
    """Wait for the current run's first committed batch; a run that ends first is an error at once."""

    def committed() -> bool:
        run = refresh(settings, membership, job_name)
        if run is None or run.state in ("FAILED", "KILLED", "FINISHED"):
            raise RuntimeError(f"job {job_name} ended before its first commit: {run and run.error}")
        return run.first_commit_at is not None

    wait_for(committed, timeout, f"job {job_name} committing its first batch")
    run = refresh(settings, membership, job_name)
    assert run is not None
    return run


def options_of(settings: Settings, job_name: str) -> dict[str, Any]:
    """The job's options (refused with the known jobs when there is no such job)."""
    with session_scope(settings.database_url) as s:
        return dict(get_job(s, job_name).options or {})


def fault_tolerant_jobs(settings: Settings) -> list[str]:
    with session_scope(settings.database_url) as s:
        return list(s.scalars(select(Job.name).where(Job.fault_tolerant.is_(True)).order_by(Job.name)))


def list_jobs(settings: Settings) -> list[dict[str, Any]]:
    with session_scope(settings.database_url) as s:
        rows = []
        standbys = {r.standby_of: r for r in s.scalars(select(JobRun).where(JobRun.standby_of.is_not(None),
                                                                             JobRun.ended_at.is_(None)))}
        for job in s.scalars(select(Job).order_by(Job.name)):
            run = current_run(s, job)
            standby = standbys.get(run.id) if run else None
            rows.append({
                "name": job.name, "module": job.module, "entry": job.entry, "fault_tolerant": job.fault_tolerant,
                "block_shutdown": job.block_shutdown, "shutdown_timeout": job.shutdown_timeout,
                "state": run.state if run else "NEW", "version": run.spark_version if run else None,
                "member": run.member if run else None, "run": run.id if run else None,
                "progress": run.progress if run else {},
                # a warm successor holding a driver and an executor on its member until the hand-over
                "standby": (f"run {standby.id} on {standby.member or 'its master'} at {standby.spark_version}, "
                            f"{'ready' if standby.ready_at else 'warming'}") if standby else None,
            })
        return rows
