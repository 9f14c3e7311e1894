"""Moving a fault-tolerant job to another version group: stop at a boundary, savepoint, resume there.

`step` is idempotent: it looks at where the job is and does the next small step only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from sqlalchemy import or_, select

from changeover import audit, faults, jobs, savepoints
from changeover.cluster import Membership
from changeover.compat.version_table import require_resumable
from changeover.errors import ChangeoverError
from changeover.handoff import lease
from changeover.jobs.intents import ContinueMove, ContinueRun, ReplaceParked
from changeover.registry.db import lock_row, session_scope
from changeover.registry.models import Event, Job, JobRun, Member, Savepoint
from changeover.registry.states import AT_A_BOUNDARY, LIVE, Desired, MemberStatus, RunState
from changeover.runtime import checkpoints
from changeover.settings import Settings
from changeover.upgrade import warm, zero_downtime

log = logging.getLogger(__name__)
MoveStep = Literal["done", "stopped_by_user", "stop", "save_and_launch", "continue_from_checkpoint", "ended"]


@dataclass(frozen=True)
class Observation:
    """What a move's step looks at: the job's current run and what is asked of the job."""
    state: str  # the run's state
    desired: str  # the job's: RUN, MOVE or STOP
    placed: bool  # the run is on the target version, and off the member being left
    member_draining: bool  # the run's member is still being drained (looked at only for a killed run)


def decide(seen: Observation) -> MoveStep:
    """The move's next step, from what it observes; `step` acts on it."""
    live = seen.state in LIVE
    if live and seen.desired == Desired.RUN and seen.placed:
        return "done"
    if seen.desired == Desired.STOP:
        return "stopped_by_user"
    if live:
        return "stop"  # a warm successor first where there is room, then the stop at a boundary
    if seen.state in AT_A_BOUNDARY:
        return "save_and_launch"
    wanted_here = seen.desired == Desired.RUN and seen.member_draining
    if seen.state == RunState.KILLED and (seen.desired == Desired.MOVE or wanted_here):
        # Its driver died before it parked (killed, or its worker lost), asked to move or not yet: Spark's checkpoint
        # is whole as of its last commit, so the job goes on from there on the target. (A user's cancel leaves the
        # job desired STOP; an abort's restart returns the member to service, so it is no longer draining.)
        return "continue_from_checkpoint"
    return "ended"


def step(
    settings: Settings,
    membership: Membership,
    job_name: str,
    target_version: str,
    reason: str,
    avoid_member: str | None = None,
    upgrade_key: str | None = None,
    strategy: str | None = None,
    catch_up: zero_downtime.CatchUp | None = None,
    code: dict[str, str] | None = None,
    savepoint_name: str | None = None,
) -> bool:
    """Advance the move of one job. True once it runs (or is launched) on the target version, off avoid_member.
    strategy: warm (a standby ready before the stop, where there is room) or zero_downtime (that standby also
    follows the live run read-only until it has caught up, `upgrade.zero_downtime`); by default the job's option
    move_strategy, else warm. code: the successor runs this code (`Job.code_of`), which is the job's from the
    hand-over on (a zero-downtime update). savepoint_name: the name of the savepoint at the stop, instead of one
    made of `reason`.

    It observes the job once, `decide`s its next step once, and hands it to that step's handler (`_STEPS`)."""
    run = jobs.refresh(settings, membership, job_name)
    with session_scope(settings.database_url) as s:
        job = jobs.get_job(s, job_name)
        desired, options = job.desired, dict(job.options or {})
    following = zero_downtime.strategy_of(strategy, options) == "zero_downtime"
    if run is None:
        raise ChangeoverError(f"move of job {job_name}", "it was never launched", "submit it first")
    move = _Move(settings, membership, job_name, target_version, reason, avoid_member, upgrade_key, catch_up, code,
                 savepoint_name, desired, options, following)
    return _STEPS[decide(move.observe(run))](move, run)


@dataclass(frozen=True)
class _Move:
    """One call of `step`: the job, where it goes and how, and what was asked of the job when the step began."""
    settings: Settings
    membership: Membership
    job_name: str
    target_version: str
    reason: str
    avoid_member: str | None
    upgrade_key: str | None
    catch_up: zero_downtime.CatchUp | None
    code: dict[str, str] | None
    savepoint_name: str | None
    desired: str  # the job's desired state, read once
    options: dict[str, Any]
    following: bool  # the zero-downtime strategy: its standby follows the live run until it has caught up

    def observe(self, run: JobRun) -> Observation:
        placed = (run.spark_version == self.target_version
                  and (self.avoid_member is None or run.member != self.avoid_member) and warm.runs_code(run, self.code))
        return Observation(run.state, self.desired, placed,
                           run.state == RunState.KILLED and _draining(self.settings, run.member))


def _done(move: _Move, run: JobRun) -> bool:
    settle_cut_over(move.settings, move.job_name, run, move.reason, move.upgrade_key, move.savepoint_name)
    return True


def _stopped_by_user(move: _Move, run: JobRun) -> bool:
    raise ChangeoverError(f"move of job {move.job_name}", "a user stopped it with a savepoint",
                          f"resume it yourself with `changeover submit {move.job_name} --from-savepoint NAME`")


def _stop(move: _Move, run: JobRun) -> bool:
    """A warm successor first where there is room (a zero-downtime one caught up), then the stop at a boundary. Once
    the run has parked, the move goes on at once with the parked run's step (`_AFTER_PARK`): a ready standby waits,
    and the downtime runs from the stop."""
    settings, membership, job_name, target_version = move.settings, move.membership, move.job_name, move.target_version
    require_resumable(run.spark_version, target_version, f"move of job {job_name} to Spark {target_version}")
    readiness = (warm.prepare(settings, membership, job_name, run, target_version, move.following, move.code,
                              leaving_member=move.avoid_member is not None)
                 if move.desired == Desired.RUN else _ready_standby(settings, membership, run.id))
    if readiness == "warming":
        return False  # the job runs on while its successor starts
    if move.following and readiness == "cold" and move.desired == Desired.RUN:
        raise ChangeoverError(f"zero-downtime move of job {job_name} to Spark {target_version}",
                              f"no follower can run for it: {_last_cold_reason(settings, job_name, run.id)}; "
                              f"the job was not stopped and runs on as run {run.id}",
                              "make room on the target group and retry, or move it with the warm strategy, "
                              "which goes cold where it must")
    standby = warm.standby_of(settings, membership, run.id) if readiness == "ready" else None
    if move.following and move.desired == Desired.RUN and standby is not None and not zero_downtime.caught_up(
            settings, membership, job_name, run, standby, move.reason, move.catch_up or zero_downtime.CatchUp(),
            move.upgrade_key):
        return False  # the job runs on while its successor follows it
    savepoints.request_stop(settings, job_name, move.reason, move=True)
    # A ready standby waits: the downtime runs from here, so the move goes on now, not at the next poll.
    # a move's stop may first wait up to half its deadline for the next batch (`StageQueries.stop_at_boundary`)
    if readiness == "cold" or not warm.wait_parked(settings, job_name, run.id,
                                                  1.5 * float(move.options.get("stop_deadline_seconds", 60)) + 5):
        return False
    run = jobs.observe(settings, membership, run.id)
    return _AFTER_PARK.get(decide(move.observe(run)), _ended)(move, run)


def _save_and_launch(move: _Move, run: JobRun) -> bool:
    """The run is at a batch boundary: a following standby is handed the job, or a savepoint is taken and restored,
    and a ready standby is handed the job from it, else a cold successor is launched from it."""
    settings, membership, job_name, code = move.settings, move.membership, move.job_name, move.code
    standby = warm.standby_of(settings, membership, run.id)
    if (standby is not None and standby.following_since is not None and standby.checkpoint_root
            and standby.spark_version == move.target_version and warm.runs_code(standby, code)
            and warm.hand_over(settings, job_name, standby.id, run.id, run.parks, Path(standby.checkpoint_root),
                               str(standby.from_savepoint))):
        zero_downtime.cut_over_savepoint(settings, job_name, run, move.reason, move.upgrade_key, move.savepoint_name)
        return True
    # One savepoint per stop: a run that resumed when its lease ran out and stopped again gets a new one.
    name = move.savepoint_name or f"{move.reason}-run{run.id}-stop{run.parks}"
    savepoints.take(settings, job_name, name, upgrade_key=move.upgrade_key, exist_ok=True)
    faults.point(settings, "relocate.saved")
    lease.extend(settings.database_url, job_name, run.id)  # a whole lease for the restore (a copy across stores)
    root = savepoints.restore(settings, job_name, name)
    standby = warm.standby_of(settings, membership, run.id)
    if (standby is not None and standby.ready_at is not None and standby.spark_version == move.target_version
            and warm.runs_code(standby, code)
            and warm.hand_over(settings, job_name, standby.id, run.id, run.parks, root, name)):
        return True
    # cold, at once: the parked run's lease is running; a standby not handed the job leaves by itself
    jobs.launch(settings, membership, job_name, move.target_version, root, ReplaceParked(run.id, run.parks),
                from_savepoint=name, code=code)
    return True


def _continue_from_checkpoint(move: _Move, run: JobRun) -> bool:
    settings, job_name, target_version = move.settings, move.job_name, move.target_version
    require_resumable(run.spark_version, target_version, f"move of job {job_name} to Spark {target_version}")
    _dismiss_standby(settings, move.membership, run.id, "its run was killed before the hand-over; the job goes on "
                     "from its checkpoint, cold")
    root = checkpoints.new_checkpoint_root(settings, job_name)
    # the launch refuses if someone stopped the move, or the run, meanwhile
    going_on = ContinueMove(run.id) if move.desired == Desired.MOVE else ContinueRun(run.id)
    jobs.launch(settings, move.membership, job_name, target_version, root, going_on, copy_from=run)
    return True


def _ended(move: _Move, run: JobRun) -> bool:
    raise ChangeoverError(f"move of job {move.job_name}", f"its run {run.id} ended as {run.state}",
                          f"resume it from its newest savepoint: `changeover submit {move.job_name} --from-savepoint "
                          "NAME`")


_STEPS: dict[MoveStep, Callable[[_Move, JobRun], bool]] = {
    "done": _done,
    "stopped_by_user": _stopped_by_user,
    "stop": _stop,
    "save_and_launch": _save_and_launch,
    "continue_from_checkpoint": _continue_from_checkpoint,
    "ended": _ended,
}
# Once `_stop` has parked the run, only these go on at once; any other step is the run's end, said as such.
_AFTER_PARK: dict[MoveStep, Callable[[_Move, JobRun], bool]] = {
    "save_and_launch": _save_and_launch,
    "continue_from_checkpoint": _continue_from_checkpoint,
}


def settle_cut_over(settings: Settings, job_name: str, run: JobRun, reason: str, upgrade_key: str | None,
                    savepoint_name: str | None = None) -> None:
    """A try that died between a follower's hand-over and the cut-over's savepoint: that savepoint is taken now,
    once."""
    predecessor = _followed(settings, run)
    if predecessor is None:
        return
    try:
        zero_downtime.cut_over_savepoint(settings, job_name, predecessor, reason, upgrade_key, savepoint_name)
    except ChangeoverError as exc:  # the move is done; only its rollback point is missing, and said so
        log.warning("job %s: the savepoint of run %s at its cut-over was not taken: %s", job_name, predecessor.id,
                    exc)


def withdraw(settings: Settings, membership: Membership, job_name: str, reason: str, **details: object) -> None:
    """Undo a job's move where it is: a parked run resumes in place, a run killed on the way (driver killed, its
    worker lost) or stopped and ended continues from its checkpoint. A run that failed on its own code is left
    down: running it again would fail again. Safe to repeat: the launch itself clears the move."""
    run = jobs.refresh(settings, membership, job_name)
    if run is not None:
        _dismiss_standby(settings, membership, run.id, f"the move was withdrawn: {reason}")
    with session_scope(settings.database_url) as s:
        job = jobs.get_job(s, job_name)
        if job.desired != Desired.MOVE:
            return
        code = job.code or ""
    ended = run is not None and (run.state == RunState.KILLED or (run.state == RunState.STOPPED and run.ended_at))
    if run is not None and not run.parked and ended:
        jobs.submit(settings, membership, code, job_name)
    with session_scope(settings.database_url) as s:
        job = lock_row(s, Job, job_name)
        if job.desired == Desired.MOVE:
            job.desired = Desired.RUN
        audit.record(s, "job.stop_withdrawn", "job", job_name, reason=reason, **details)


def _last_cold_reason(settings: Settings, job_name: str, run_id: int) -> str:
    with session_scope(settings.database_url) as s:
        event = s.scalar(select(Event).where(Event.subject == job_name, Event.action == "job.move.cold")
                         .order_by(Event.id.desc()).limit(1))
        details = event.details if event is not None else {}
        return str(details.get("reason")) if details.get("run") == run_id else "its standby was not ready in time"


def _followed(settings: Settings, run: JobRun) -> JobRun | None:
    """The run a zero-downtime successor replaced, while the cut-over's savepoint of it is still to be taken (a try
    that died between the hand-over and the savepoint)."""
    if run.following_since is None or run.standby_of is None:
        return None
    with session_scope(settings.database_url) as s:
        predecessor = s.get(JobRun, run.standby_of)
        if predecessor is None:
            return None
        # at the batch it parked on for this hand-over: one of an earlier cut-over it took back is not this one's
        taken = any(zero_downtime.at_park(sp.stages, predecessor) for sp in s.scalars(select(Savepoint).where(
            Savepoint.run_id == run.standby_of, Savepoint.mode == "stop", Savepoint.status == "COMPLETED")))
        return None if taken else predecessor


def _draining(settings: Settings, member: str | None) -> bool:
    """Its member is still being drained: an abort's restart also leaves runs KILLED and wanted, and goes on with
    them where they were, not on the target."""
    with session_scope(settings.database_url) as s:
        row = s.get(Member, member) if member else None
        return row is not None and row.status == MemberStatus.DRAINING


def _ready_standby(settings: Settings, membership: Membership, run_id: int) -> warm.Readiness:
    """The job was asked to stop already (a retried try): a ready standby takes it over; one still warming would only
    compete for cores with the cold successor, so it is dismissed."""
    standby = warm.standby_of(settings, membership, run_id)
    if standby is not None and standby.ready_at is None:
        jobs.dismiss_standby(settings, membership, standby.id, "the job was asked to stop before its standby was "
                             "ready; it moves cold")
    return "ready" if standby is not None and standby.ready_at is not None else "cold"


def _dismiss_standby(settings: Settings, membership: Membership, run_id: int, reason: str) -> None:
    standby = warm.standby_of(settings, membership, run_id)
    if standby is not None:
        jobs.dismiss_standby(settings, membership, standby.id, reason)


MAX_TRIES_PER_DRAIN = 3  # successors that ended before writing, of any cause, before a drain stops trying


def failed_tries(settings: Settings, job_name: str, since: datetime) -> list[JobRun]:
    """Successors of the job launched since `since` that ended before writing anything, newest first, when moving it
    again would be futile: one failed on its own code (the new version fails the job's first batch, say), or
    MAX_TRIES_PER_DRAIN ended for any cause (killed, lost, never accepted). Empty otherwise."""
    with session_scope(settings.database_url) as s:
        current = jobs.get_job(s, job_name).current_run_id
        # a standby dismissed before it was handed the job ran nothing: not a try; one that failed is
        tries = list(s.scalars(select(JobRun).where(
            JobRun.job == job_name, JobRun.submitted_at >= since, JobRun.ended_at.is_not(None),
            JobRun.first_write_at.is_(None), JobRun.id != current,
            or_(JobRun.standby_of.is_(None), JobRun.checkpoint_root.is_not(None), JobRun.state == RunState.FAILED))
            .order_by(JobRun.id.desc())))
    if any(run.state == RunState.FAILED for run in tries) or len(tries) >= MAX_TRIES_PER_DRAIN:
        return tries
    return []
