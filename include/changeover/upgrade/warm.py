"""Warm moves: a job's successor is started, and waits ready, before the job is asked to stop.

A cold move stops the job, then launches its successor from the savepoint, so the job is down for a driver's
start, its executors and its first batch. A warm move first launches the successor as a standby on the target
group: its own run, not yet the job's current one. It starts its session, gets an executor, builds its plans and
says it is ready. Only then is the job asked to stop at a batch boundary; the savepoint is taken and restored as in
a cold move, and the restored checkpoint is handed to the standby, which starts its queries at once.

Nothing is lost either way. A standby not ready in time is dismissed before the job is ever stopped, and the move
goes cold. A standby that fails after the hand-over, before its first batch is done, hands the job back to the parked
run, at the batch of the savepoint (`handoff.lease`); every sink refuses the standby's writes from then on.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Literal

from sqlalchemy import func, or_, select

from changeover import audit, jobs
from changeover.cluster import Membership, routing
from changeover.errors import ChangeoverError
from changeover.handoff import lease
from changeover.handoff.ownership import own_job
from changeover.jobs.intents import Standby
from changeover.registry.db import lock_row, session_scope
from changeover.registry.models import Job, JobRun, utcnow
from changeover.registry.states import Desired, RunState
from changeover.settings import Settings
from changeover.timeutil import as_utc
from changeover.upgrade import placement

READY_SECONDS = lease.STANDBY_READY_SECONDS
MAX_FOLLOWERS = 3  # zero-downtime followers of one run, aborted or not, before its move is refused
PARK_POLL_SECONDS = 0.05
Readiness = Literal["ready", "warming", "cold"]


def standby_of(settings: Settings, membership: Membership, run_id: int) -> JobRun | None:
    """The run's live standby, as its master sees it now; None when it has none."""
    with session_scope(settings.database_url) as s:
        ids = list(s.scalars(select(JobRun.id).where(JobRun.standby_of == run_id, JobRun.ended_at.is_(None))))
    return next((run for run in (jobs.observe(settings, membership, i) for i in ids) if run.ended_at is None), None)


def warming(standby: JobRun) -> bool:
    """Still starting, and within its time to get ready."""
    return standby.ready_at is None and (utcnow() - as_utc(standby.submitted_at)).total_seconds() < READY_SECONDS


def planned_cold_reason(settings: Settings, job_name: str, from_version: str, target: str,
                        leaving_member: bool = True) -> str | None:
    """Why a move of this job from `from_version` to `target` will be cold whatever the cluster then looks like, or
    None when it can be warm (the preflight's plan says so; capacity is looked at when the move comes).
    leaving_member: the move takes the job off a member (a drain), not only onto other code."""
    with session_scope(settings.database_url) as s:
        job = jobs.get_job(s, job_name)
        entry, warm_moves = job.entry, (job.options or {}).get("warm_moves", True)
    if entry != "build":
        return f"its entry point ({entry}) runs its own queries, so nothing of it can start before its checkpoint"
    if warm_moves is False:
        return "its option warm_moves is off"
    if target == from_version and leaving_member:
        return (f"it moves within the {target} group, whose master could place a standby on the member it leaves "
                "(Spark standalone places drivers itself)")
    return None


def cold_reason(settings: Settings, membership: Membership, job_name: str, run: JobRun, target: str,
                follow: bool = False, leaving_member: bool = True) -> str | None:
    """Why this move cannot be warm, or None when it can. follow: for a zero-downtime move, a follower that was
    aborted (it did not catch up in time) does not keep the next try from starting another."""
    planned = planned_cold_reason(settings, job_name, run.spark_version, target, leaving_member)
    if planned is not None:
        return planned
    with session_scope(settings.database_url) as s:
        ended = select(JobRun).where(JobRun.standby_of == run.id, JobRun.ended_at.is_not(None))
        if follow:  # an aborted follower ended STOPPED; one that failed on its own (FAILED, KILLED) still counts
            followers = s.scalar(select(func.count()).select_from(JobRun).where(
                JobRun.standby_of == run.id, JobRun.following_since.is_not(None)))
            if followers >= MAX_FOLLOWERS:
                return f"{followers} followers of run {run.id} ended without taking the job over"
            ended = ended.where(or_(JobRun.following_since.is_(None), JobRun.state != RunState.STOPPED))
        tried = s.scalar(ended.order_by(JobRun.id.desc()).limit(1))
        if tried is not None:
            return f"its standby run {tried.id} ended {tried.state} ({tried.error or 'no reason recorded'})"
    members = routing.version_groups(settings).get(target, [])
    with session_scope(settings.database_url) as s:  # launched but not placed yet: the master shows no cores taken
        launched = list(s.scalars(select(JobRun.id).where(
            JobRun.standby_of.is_not(None), JobRun.ended_at.is_(None), JobRun.member.is_(None),
            JobRun.spark_version == target)))
    unplaced = sum(1 for run in (jobs.observe(settings, membership, i) for i in launched)
                   if run.ended_at is None and run.member is None and warming(run))
    free = placement.free_cores_of(settings, membership)(target, members) - unplaced * placement.CORES_PER_JOB
    if free < placement.CORES_PER_JOB:
        return (f"the {target} group has {max(free, 0)} free core(s) (besides {unplaced} standby(s) being placed), "
                f"and a standby needs {placement.CORES_PER_JOB} (a driver and an executor) beside the jobs it runs")
    return None


def prepare(settings: Settings, membership: Membership, job_name: str, run: JobRun, target: str,
            follow: bool = False, code: dict[str, str] | None = None, leaving_member: bool = True) -> Readiness:
    """Before a running job is asked to stop for a move: launch its standby on `target`, or see whether it is
    ready. "cold" when the move cannot be warm (the reason is on record) or its standby was not ready in time.
    follow: the standby is for a zero-downtime move (`cold_reason`). code: the standby runs this code, not the
    job's (a zero-downtime update)."""
    standby = standby_of(settings, membership, run.id)
    if standby is not None and (standby.spark_version != target or not runs_code(standby, code)):
        # the target changed: before the stop, not after
        wanted = (code or {}).get("code") or "the job's own"
        jobs.dismiss_standby(settings, membership, standby.id, f"the move's target is now {target}, code {wanted}")
        standby = None
    if standby is not None:
        if standby.ready_at is not None:
            return "ready"
        if warming(standby):
            return "warming"
        jobs.dismiss_standby(settings, membership, standby.id, f"not ready within {READY_SECONDS:.0f} s of its "
                             "launch; the job was never stopped, and it moves cold")
        return "cold"
    why = cold_reason(settings, membership, job_name, run, target, follow, leaving_member)
    if why is not None:
        with session_scope(settings.database_url) as s:
            audit.record(s, "job.move.cold", "job", job_name, run=run.id, version=target, reason=why)
        return "cold"
    try:
        jobs.launch(settings, membership, job_name, target, None, Standby(run.id), code=code)
    except ChangeoverError as exc:  # the target's master, or a standby another try launched: the job moves cold
        with session_scope(settings.database_url) as s:
            audit.record(s, "job.move.cold", "job", job_name, run=run.id, version=target, reason=str(exc))
        return "cold"
    return "warming"


def runs_code(run: JobRun, code: dict[str, str] | None) -> bool:
    """Whether the run was launched with `code` (None: whatever code, the job's own)."""
    return code is None or (run.code or {}).get("code") == code["code"]


def wait_parked(settings: Settings, job_name: str, run_id: int, seconds: float) -> bool:
    """Wait, up to `seconds`, for a run asked to move to park at its batch boundary. False when it did not, or its
    stop was withdrawn (a batch ran past the stop deadline): the caller looks again at its next step."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with session_scope(settings.database_url) as s:
            job, run = s.get(Job, job_name), s.get(JobRun, run_id)
            if job is None or run is None or job.desired != Desired.MOVE or job.current_run_id != run_id:
                return False
            if run.ended_at is not None:
                return False
            if run.parked:
                return True
        time.sleep(PARK_POLL_SECONDS)
    return False


def hand_over(settings: Settings, job_name: str, standby_id: int, predecessor: int, parks: int, root: Path,
              savepoint: str) -> bool:
    """Give a ready standby the restored checkpoint: it becomes the job's current run and starts its queries. The
    parked run's lease counts from now, as after a cold launch. False when the standby has ended (launch cold
    instead); refused, like a cold launch, when the parked run resumed or stopped again meanwhile."""
    with session_scope(settings.database_url) as s:
        job = lock_row(s, Job, job_name)
        before, standby = jobs.current_run(s, job), s.get(JobRun, standby_id)
        assert standby is not None
        if standby.ended_at is not None:
            return False
        if (job.current_run_id != predecessor or job.desired != Desired.MOVE or before is None or not before.parked
                or before.parks != parks):
            raise ChangeoverError(f"hand-over of job {job_name} from run {predecessor} to its standby {standby_id}",
                                  "the run is no longer parked where its savepoint was taken (it resumed meanwhile, "
                                  "or stopped again), or the job is no longer asked to move (a user stopped it, or "
                                  "the move was withdrawn)", "retry the task: it looks at the job again")
        now = utcnow()
        standby.checkpoint_root, standby.from_savepoint, standby.state = str(root), savepoint, "RUNNING"
        before.code = before.code or job.code_of()  # what the job goes back to if the parked run takes it back
        audit.record(s, "job.hand_over", "job", job_name, run=standby_id, replaces=predecessor,
                     version=standby.spark_version, from_savepoint=savepoint,
                     ready_seconds=round((now - as_utc(standby.ready_at or now)).total_seconds(), 1))
        own_job(s, job, standby, f"handed over from run {predecessor}")
        job.desired = Desired.RUN
        before.lease_until = now + timedelta(seconds=lease.length_of(job))
    return True
