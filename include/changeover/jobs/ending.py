"""Ending a job's runs: a user's cancel, a fault-tolerant run ended for its worker's restart, a standby dismissed, and
the driver's kill through its master."""

from __future__ import annotations

from typing import Any

from changeover import audit
from changeover.cluster import Membership, wait_for
from changeover.handoff import lease
from changeover.registry.db import lock_row, session_scope
from changeover.registry.models import Job, JobRun, utcnow
from changeover.registry.records import LIVE, current_run, get_job
from changeover.registry.states import Desired
from changeover.settings import Settings
from changeover.timeutil import as_utc


def cancel(settings: Settings, membership: Membership, job_name: str, reason: str) -> None:
    with session_scope(settings.database_url) as s:
        job = lock_row(s, Job, job_name)
        run = current_run(s, job)
        if run is None or run.state not in LIVE or run.submission_id is None:
            return
        # First, under the job's lock: a cancel is someone's intent, and no drain, rebalance or abort that sees
        # the run end afterwards brings the job back.
        job.desired = Desired.STOP
        version, submission, run_id = run.spark_version, run.submission_id, run.id
    _kill(settings, membership, run_id, version, submission, "KILLED", reason, "job.cancel")


def end_for_restart(settings: Settings, membership: Membership, run_id: int, reason: str) -> None:
    """End a fault-tolerant run's driver so that it can go on from its checkpoint elsewhere or after its worker's
    restart; unlike a cancel, the job stays wanted (desired RUN). A parked run ends STOPPED on its boundary."""
    with session_scope(settings.database_url) as s:
        run = s.get(JobRun, run_id)
        assert run is not None
        if run.ended_at is not None or run.submission_id is None:
            return
        version, submission, parked = run.spark_version, run.submission_id, run.parked
    _kill(settings, membership, run_id, version, submission, "STOPPED" if parked else "KILLED", reason, "job.end")


def dismiss_standby(settings: Settings, membership: Membership, run_id: int, reason: str) -> bool:
    """End a warm standby that will not be handed its job (not ready in time, or its move was withdrawn). It never
    ran a query, so it ends STOPPED with the reason; a driver not yet started finds its run ended and exits.
    False when it was handed its job meanwhile: then it is the job's run, and stays."""
    with session_scope(settings.database_url) as s:
        run = s.get(JobRun, run_id)
        assert run is not None
        job, version, submission = run.job, run.spark_version, run.submission_id
    if not lease.end_standby(settings.database_url, job, run_id, reason, "job.standby.dismiss"):
        with session_scope(settings.database_url) as s:  # ended already, or handed the job meanwhile
            return get_job(s, job).current_run_id != run_id
    if submission is not None:  # one not yet started finds its run ended and exits
        kill_driver(membership.master(version), submission, f"the driver of standby run {run_id}")
    return True


def _kill(settings: Settings, membership: Membership, run_id: int, version: str, submission: str, state: str,
          reason: str, action: str) -> None:
    """Kill a live run's driver through its master and record the run as `state`, whatever the dying driver wrote
    meanwhile (a query started as its SparkContext stopped reports FAILED): the end is ours, and its checkpoint
    ends on its last commit, or on the boundary it parked at. Returns once the master says the driver has ended,
    so a resubmit may then take over its checkpoint."""
    asked = utcnow()
    kill_driver(membership.master(version), submission, f"the driver of run {run_id}")
    with session_scope(settings.database_url) as s:
        run = s.get(JobRun, run_id)
        assert run is not None
        if run.ended_at is None or as_utc(run.ended_at) >= asked:  # an end the run recorded before is its own
            said = (run.error or "").splitlines()[0][:300] if run.error else "no reason"
            written = f" (its driver wrote, dying: {run.state}, {said})" if run.ended_at is not None else ""
            run.state, run.error = state, reason + written
            run.ended_at, run.lease_until = run.ended_at or utcnow(), None
        audit.record(s, action, "job", run.job, run=run_id, state=run.state, reason=reason)


def kill_driver(master: Any, submission: str, what: str) -> None:
    """Kill a driver through its master; returns once the master says it has ended."""
    master.kill(submission)
    wait_for(lambda: master.status(submission).state not in ("SUBMITTED", "RUNNING", "RELAUNCHING"), 120,
             f"{what} ending after its kill")
