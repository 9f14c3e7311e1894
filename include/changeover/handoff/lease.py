"""A stopped job always comes back: the lease of a parked run.

A fault-tolerant run asked to stop does not exit at the batch boundary. It parks: its queries are
stopped, its driver stays up, and it holds a lease. It exits once its successor has written output.
If no successor has written by the end of the lease, whatever happened to the orchestrator (a failed
task, a deadlock, a killed scheduler), the parked run reclaims the job and resumes in place. The
successor, if one was launched, is fenced off: its sink writes are refused (see `handoff.fence`). Every decision
is taken under the job row's lock, the same lock the sink's fence takes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from sqlalchemy import select, update

from changeover import audit
from changeover.handoff.fence import moving_predecessor, predecessor_stopping
from changeover.handoff.ownership import own_job
from changeover.registry.db import bound_lock_waits, lock_row, session_scope
from changeover.registry.models import Job, JobRun, utcnow
from changeover.registry.states import Desired, RunState
from changeover.timeutil import as_utc

DEFAULT_LEASE_SECONDS = 120.0
STANDBY_READY_SECONDS = 240.0  # from a standby's launch to its readiness on a loaded cluster; then the move goes cold
ParkedAction = Literal["wait", "exit", "resume"]  # what a parked run does next (`next_action`)
# Whether the sinks a run described (stage -> description, as the registry keeps them) hold a write of another
# run, asked of each sink's own store: `next_action` is given it (`runtime.sinks.hold_a_write_of`), so the lease passes
# the descriptions on as data and imports no sink.
SinksHoldAWriteOf = Callable[[str, str, dict[str, dict[str, Any]], int], bool]
StandbyTurn = Literal["wait", "follow", "cut_over", "start", "dismissed"]


DEFAULT_LOST_AFTER_SECONDS = 180.0


def lease_seconds() -> float:
    return float(os.environ.get("CHANGEOVER_LEASE_SECONDS") or DEFAULT_LEASE_SECONDS)


HEARTBEAT_SECONDS = 5.0  # how often a live driver reports itself


def lost_after_seconds() -> float:
    """How long a run may go unheard, by its master and by its own heartbeat, before it is recorded as lost."""
    return float(os.environ.get("CHANGEOVER_LOST_AFTER_SECONDS") or DEFAULT_LOST_AFTER_SECONDS)


def self_fence_seconds() -> float:
    """How long a running driver may go without confirming that it is its job's current run before it stops its
    queries: half the loss deadline, so they have stopped before the control plane may record it lost for its
    silence and let a successor write (the idea of Flink's leader sessions and Kafka's session timeout)."""
    return lost_after_seconds() / 2


def length_of(job: Job) -> float:
    """A job's lease length: its option lease_seconds, else the default."""
    return float((job.options or {}).get("lease_seconds") or lease_seconds())


def park(url: str, job: str, run_id: int, progress: dict[str, int | None], seconds: float) -> None:
    with session_scope(url) as s:
        run = s.get(JobRun, run_id)
        assert run is not None
        if run.parked or run.ended_at is not None:
            return  # parked already (a retry whose first commit's answer was lost), or ended meanwhile: left so
        now = utcnow()
        run.state, run.progress, run.heartbeat_at = RunState.PARKED, dict(progress), now
        run.parks = (run.parks or 0) + 1
        run.lease_until = now + timedelta(seconds=seconds)
        audit.record(s, "job.park", "job", job, run=run_id, progress=progress, lease_seconds=seconds,
                     lease_until=run.lease_until.isoformat())


def take_over(url: str, job: str, run_id: int) -> bool:
    """A successor that has run its first cycle takes the job over, data or none: from then on the parked
    run it replaces exits instead of reclaiming. False when this run was fenced off first."""
    with session_scope(url) as s:
        row = lock_row(s, Job, job)
        run = s.get(JobRun, run_id)
        assert row is not None and run is not None
        if row.current_run_id != run_id:
            return False
        if run.first_write_at is None:
            run.first_write_at = utcnow()
        return True


def extend(url: str, job: str, run_id: int) -> float | None:
    """The savepoint being built from a parked run keeps its lease from running out under it: without this, a large
    state or a slow store let the lease lapse mid-build, the run resumed, and the next try parked it again under a
    new savepoint, never moving. Only while the run is parked for a move that stands; returns the job's lease length
    then, else None (resumed, handed over, or the stop withdrawn: nothing to hold)."""
    with session_scope(url) as s:
        row = lock_row(s, Job, job)
        run = s.get(JobRun, run_id)
        if row is None or run is None or not run.parked or run.lease_until is None \
                or row.current_run_id != run_id or row.desired != Desired.MOVE:
            return None
        length = length_of(row)
        until = utcnow() + timedelta(seconds=length)
        if until > as_utc(run.lease_until):
            run.lease_until = until
            audit.record(s, "job.lease.extend", "job", job, run=run_id, lease_until=until.isoformat(),
                         reason="its savepoint is being built")
        return length


@dataclass(frozen=True)
class Successor:
    """The job's current run, as a parked run it replaced sees it."""

    id: int
    state: str
    wrote: bool  # took the job over: its first batch ran (or committed)
    ended: bool
    starting: bool  # alive and still starting, within its grace (`_starting`)


@dataclass(frozen=True)
class Parked:
    """What a parked run's decision looks at, read under the job row's lock."""

    ended: bool  # recorded as ended (by the control plane, say)
    desired: str  # the job's desired state: RUN, STOP or MOVE
    current: bool  # still the job's current run
    taken_over_since: bool  # some later run of the job has written
    expired: bool  # its lease ran out
    successor: Successor | None  # the job's current run, when it is another


@dataclass(frozen=True)
class Verdict:
    decision: ParkedAction
    event: str | None = None  # the audit action: job.handoff, job.stop or job.unpark; none for a wait
    reason: str | None = None
    reclaim: bool = False  # make this run the job's current one again
    run_again: bool = False  # set the job's desired state back to RUN


def decide_parked(run: Parked) -> Verdict:
    """The parked run's rules, as a pure function of what it observes (tested as a table)."""
    if run.ended or run.desired == Desired.STOP or run.taken_over_since:
        # recorded as ended, stopped by a user, or some later run has taken over: never reclaim
        return Verdict("exit", "job.stop" if run.desired == Desired.STOP else "job.handoff")
    successor = run.successor
    if not run.current:
        if successor is not None and successor.wrote:
            return Verdict("exit", "job.handoff")
        if successor is not None and successor.ended:
            # e.g. the new version failed the job on its first batch: no reason to wait out the lease
            return Verdict("resume", "job.unpark", f"its successor run {successor.id} ended {successor.state} before "
                           "writing anything", reclaim=True, run_again=True)
        if run.expired and not (successor is not None and successor.starting):
            return Verdict("resume", "job.unpark", "its lease ran out before the successor wrote anything; the "
                           "successor is fenced", reclaim=True, run_again=True)
        return Verdict("wait")
    if run.desired == Desired.RUN:
        return Verdict("resume", "job.unpark", "the stop was withdrawn")
    if not run.expired:
        return Verdict("wait")
    return Verdict("resume", "job.unpark", "its lease ran out and no successor was launched", run_again=True)


def next_action(url: str, job: str, run_id: int, sinks_hold_a_write_of: SinksHoldAWriteOf) -> ParkedAction:
    """What a parked run does now: keep waiting, exit (handed over), or resume (lease out, or stop withdrawn).
    Not pure: it reads the rows under the job row's lock, decides (`decide_parked`, the pure rules), and writes
    what it decided (the run ended, or resumed and the job reclaimed), all under that lock."""
    with session_scope(url) as s:
        row = lock_row(s, Job, job)
        run = s.get(JobRun, run_id)
        assert row is not None and run is not None
        now = utcnow()
        successor = s.get(JobRun, row.current_run_id) if row.current_run_id not in (None, run_id) else None
        seen = None if successor is None else Successor(
            successor.id, successor.state,
            bool(successor.first_write_at or successor.first_commit_at)
            or sinks_hold_a_write_of(url, job, dict(run.sinks or {}), successor.id),
            successor.ended_at is not None,
            _starting(successor, run, length_of(row), now))
        verdict = decide_parked(Parked(
            ended=run.ended_at is not None, desired=row.desired, current=row.current_run_id == run_id,
            # read only when it can decide: an ended or stopped run exits whatever it says
            taken_over_since=run.ended_at is None and row.desired != Desired.STOP and _taken_over_since(s, job, run_id),
            expired=run.lease_until is not None and now >= as_utc(run.lease_until), successor=seen))
        if verdict.decision == "exit":
            run.ended_at, run.lease_until = run.ended_at or now, None
            if run.state == RunState.PARKED:
                run.state = RunState.STOPPED
            audit.record(s, str(verdict.event), "job", job, run=run_id, successor=row.current_run_id,
                         **({"reason": verdict.reason} if verdict.reason else {}))
        elif verdict.decision == "resume":
            if verdict.reclaim:
                own_job(s, row, run, "the parked run took its job back")
            if verdict.run_again:
                row.desired = Desired.RUN
            _resume(s, job, run, str(verdict.reason),
                    **({"successor": seen.id if seen else None} if verdict.reclaim else {}))
        return verdict.decision


STARTING_HEARTBEAT_SECONDS = 15.0  # a successor heard from this recently is alive
GRACE_LEASES = 2  # how many more lease lengths a live successor may take to start, on a loaded cluster


def _starting(successor: JobRun | None, run: JobRun, length: float, now: Any) -> bool:
    """A successor that is alive and still starting (its driver heartbeats from its session's start) gets more
    time: fencing it and resuming the old run would only start the same slow launch again. Bounded, so a
    successor stuck starting still hands the job back."""
    if successor is None or successor.ended_at is not None or successor.heartbeat_at is None:
        return False
    if run.lease_until is None:
        return False
    fresh = (now - as_utc(successor.heartbeat_at)).total_seconds() <= STARTING_HEARTBEAT_SECONDS
    cap = as_utc(run.lease_until) + timedelta(seconds=GRACE_LEASES * length)
    return fresh and now < cap


def _taken_over_since(s: Any, job: str, run_id: int) -> bool:
    later = select(JobRun.id).where(JobRun.job == job, JobRun.id > run_id, JobRun.first_write_at.is_not(None))
    return s.scalar(later.limit(1)) is not None


def _resume(s: object, job: str, run: JobRun, why: str, **details: object) -> None:
    run.state, run.lease_until, run.heartbeat_at, run.stopping_after = RunState.RUNNING, None, utcnow(), None
    audit.record(s, "job.unpark", "job", job, run=run.id, reason=why, **details)  # type: ignore[arg-type]


def mark_ready(url: str, run_id: int, plans: dict[str, Any] | None) -> bool:
    """A warm standby has its session, executors and plans: the orchestrator may now ask its predecessor to stop.
    False when it was dismissed meanwhile."""
    with session_scope(url) as s:
        run = s.get(JobRun, run_id)
        assert run is not None
        if run.ended_at is not None:
            return False
        now = utcnow()
        run.ready_at, run.heartbeat_at, run.plans = now, now, plans
        audit.record(s, "job.standby.ready", "job", run.job, run=run_id, standby_of=run.standby_of,
                     seconds=round((now - as_utc(run.submitted_at)).total_seconds(), 1))
        return True


def standby_turn(url: str, job: str, run_id: int) -> StandbyTurn:
    """What a waiting standby does now: start (it was handed the job, its checkpoint root is in its row), follow
    its predecessor read-only (given a checkpoint of its own, `upgrade.zero_downtime`), cut over (a follower whose
    predecessor is stopping for the move: it starts its queries, their writes waiting for the hand-over), keep waiting,
    or exit (dismissed, or the run it was to succeed is no longer the job's, e.g. stopped by a user)."""
    with session_scope(url) as s:
        row = s.get(Job, job)
        run = s.get(JobRun, run_id)
        assert row is not None and run is not None
        if run.ended_at is not None:
            return "dismissed"
        if row.current_run_id == run_id and run.checkpoint_root:
            return "start"
        predecessor = _predecessor(s, run)
        if predecessor is None or row.current_run_id != predecessor.id or predecessor.ended_at is not None:
            return "dismissed"
        if run.following_since is None or not run.checkpoint_root:
            return "wait"
        return "cut_over" if predecessor_stopping(s, row, run) else "follow"


def _predecessor(s: Any, run: JobRun | None) -> JobRun | None:
    """The run a standby is to succeed, None for a run that is no standby."""
    return s.get(JobRun, run.standby_of) if run is not None and run.standby_of is not None else None


def followed(url: str, run_id: int) -> tuple[Path, Path] | None:
    """A following standby's own checkpoint root, and its predecessor's, which it replays; None for one not given a
    checkpoint to follow with."""
    with session_scope(url) as s:
        run = s.get(JobRun, run_id)
        predecessor = _predecessor(s, run)
        if run is None or run.following_since is None or not run.checkpoint_root or predecessor is None \
                or not predecessor.checkpoint_root:
            return None
        return Path(run.checkpoint_root), Path(predecessor.checkpoint_root)


def predecessor_stopped(url: str, run_id: int) -> bool:
    """Whether the run a follower follows has stopped: parked, or ended. A stop is recorded after its last commit."""
    with session_scope(url) as s:
        run = s.get(JobRun, run_id)
        predecessor = _predecessor(s, run)
        return predecessor is None or predecessor.parked or predecessor.ended_at is not None


def is_followed(url: str, run_id: int) -> bool:
    """Whether a live follower follows the run (`upgrade.zero_downtime`): its stop for a move then comes after a
    batch begun after the stop was asked (`StageQueries.stop_at_boundary`)."""
    with session_scope(url) as s:
        return s.scalar(select(JobRun.id).where(JobRun.standby_of == run_id, JobRun.following_since.is_not(None),
                                                JobRun.ended_at.is_(None)).limit(1)) is not None


def predecessor_moving(url: str, run_id: int) -> bool:
    """Whether the run a follower follows is asked to stop for the move: the batch it runs may be its last, which
    the follower's own queries run instead of a replay (`Standby._prime`)."""
    with session_scope(url) as s:
        run = s.get(JobRun, run_id)
        job = s.get(Job, run.job) if run is not None else None
        return job is not None and moving_predecessor(s, job, run) is not None


def announce_last_batch(url: str, run_id: int, batches: dict[str, int]) -> None:
    """A run stopping for a move has begun the batch it stops after: its follower replays up to that batch and no
    further, then starts its queries once the run has parked, before it is handed the job. Empty: the run names no
    batch (a stage had none to wait for), and its follower replays what it runs again, up to the park."""
    with session_scope(url) as s:
        bound_lock_waits(s)
        run = s.get(JobRun, run_id)
        job = lock_row(s, Job, run.job) if run is not None else None
        if run is not None and job is not None and run.ended_at is None and job.current_run_id == run_id \
                and job.desired == Desired.MOVE:  # not a stop withdrawn meanwhile (`Driver.stop_failed`)
            run.stopping_after = dict(batches)


def stopping_after(url: str, run_id: int) -> dict[str, int] | None:
    """The batch the run a follower follows stops after, per stage, once it has said so (`announce_last_batch`)."""
    with session_scope(url) as s:
        run = s.get(JobRun, run_id)
        predecessor = _predecessor(s, run)
        return dict(predecessor.stopping_after) if predecessor is not None and predecessor.stopping_after else None


def report_following(url: str, run_id: int, progress: dict[str, int | None]) -> None:
    """A follower's replayed batches, for the orchestrator and `changeover jobs`. Never a commit time: a follower
    writes nothing, and a parked run reads a successor's commit as its having taken over."""
    with session_scope(url) as s:
        s.execute(update(JobRun).where(JobRun.id == run_id, JobRun.ended_at.is_(None))
                  .values(progress=dict(progress), heartbeat_at=utcnow()))


def record_level(url: str, job: str, run_id: int, at: dict[str, int | None], how: str, seconds: float) -> None:
    """For the audit: a follower level with its predecessor's last batch at the cut-over, and how it got there:
    `in_queries` (the job's own queries ran that batch beside the predecessor), `after_park` (replayed up to the park,
    queries started after it) or `after_hand_over` (handed the job before it had begun)."""
    with session_scope(url) as s:
        audit.record(s, "job.follow.level", "job", job, run=run_id, at=dict(at), how=how, seconds=round(seconds, 2))


def end_standby(url: str, job: str, run_id: int, why: str, action: str = "job.standby.end") -> bool:
    """A standby that leaves, or is dismissed, without having run a query: ended STOPPED. False when it had ended
    already or was handed the job meanwhile: it is ended first, under the lock the hand-over takes, so no hand-over
    follows an end."""
    with session_scope(url) as s:
        row = lock_row(s, Job, job)
        run = s.get(JobRun, run_id)
        assert row is not None and run is not None
        if run.ended_at is not None or row.current_run_id == run_id:
            return False
        run.state, run.ended_at, run.error = RunState.STOPPED, utcnow(), why
        audit.record(s, action, "job", job, run=run_id, state=RunState.STOPPED, reason=why)
        return True
