"""The fence: a run writes only while it is its job's current run, decided under the job row's lock.

The lock is the one a launch takes to make a successor current and a parked run takes to reclaim its job,
so a write that passed the check lands before any of those, and a write after them is refused.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from changeover import audit, faults
from changeover.errors import ChangeoverError
from changeover.registry.db import bound_lock_waits, lock_row, session_scope
from changeover.registry.models import Job, JobRun, utcnow
from changeover.registry.states import Desired


class Fenced(ChangeoverError):
    """A run that is no longer its job's current run tried to write: its output must not land."""


@dataclass(frozen=True)
class Held:
    session: Session  # the registry transaction that holds the job row's lock
    epoch: int  # the writer's fencing epoch: larger for every later owner of the job

    def confirm(self) -> None:
        """Just before a write that lands outside the registry's transaction (a files sink's log entry): the lock is
        still held. A connection lost since the lock was taken released it, so this raises the database's error,
        and the caller's retry takes the lock again, rather than write while a successor may be current."""
        self.session.execute(text("SELECT 1"))


HAND_OVER_POLL_SECONDS = 0.02  # a primed follower's first write waits on this: the move's downtime does too
HAND_OVER_CHECK_SECONDS = 0.5  # how often that wait looks again at whether the hand-over is still coming
HAND_OVER_WAIT_SECONDS = 3600.0  # a backstop: the parked run's lease ends a hand-over that does not come far sooner


def moving_predecessor(s: Session, row: Job, run: JobRun | None) -> JobRun | None:
    """The run that `run`, a live follower, follows, when it is still the job's current run and asked to move."""
    if run is None or run.ended_at is not None or run.standby_of is None or run.following_since is None:
        return None
    if row.current_run_id != run.standby_of or row.desired != Desired.MOVE:
        return None
    predecessor = s.get(JobRun, run.standby_of)
    return predecessor if predecessor is not None and predecessor.ended_at is None else None


def predecessor_stopping(s: Session, row: Job, run: JobRun | None, parked_only: bool = False) -> bool:
    """Whether `run` is a follower whose predecessor, the job's current run, is stopping for a move: it has parked,
    or (unless `parked_only`) it has said which batch it stops after."""
    predecessor = moving_predecessor(s, row, run)
    return predecessor is not None and (predecessor.parked
                                        or (not parked_only and predecessor.stopping_after is not None))


def awaiting_hand_over(s: Session, row: Job, run: JobRun | None) -> bool:
    """A follower whose predecessor has parked for the move starts its queries (`runtime.standby`): their first
    write waits for the hand-over instead of being refused."""
    return predecessor_stopping(s, row, run, parked_only=True)


def _wait_for_hand_over(url: str, job: str, run_id: int, until: float, give_up: threading.Event | None) -> None:
    """Until the run is handed the job, no longer waits for it, or its driver gives up (it stands down, or ends
    its queries); the lock decides which. Reads the job's owner often and the rest now and then."""
    checked = time.monotonic()
    while time.monotonic() < until and not (give_up is not None and give_up.is_set()):
        with session_scope(url) as s:
            if s.scalar(select(Job.current_run_id).where(Job.name == job)) == run_id:
                return
            if time.monotonic() - checked >= HAND_OVER_CHECK_SECONDS:
                checked = time.monotonic()
                row = s.get(Job, job)
                if row is None or not awaiting_hand_over(s, row, s.get(JobRun, run_id)):
                    return
        time.sleep(HAND_OVER_POLL_SECONDS)


def _require_at_the_park(s: Session, run: JobRun, what: str) -> None:
    """A follower's first write comes from the batch its predecessor parked at: its replays reached that batch (its
    progress, reported once caught up). A follower caught up to an earlier park of a run that resumed and parked
    again since would write from a state and offsets the job left behind."""
    predecessor = s.get(JobRun, run.standby_of) if run.following_since is not None and run.standby_of else None
    if predecessor is None or not predecessor.parked:
        return
    own, parked = dict(run.progress or {}), dict(predecessor.progress or {})
    # the stages both have: an update's new code may add or drop one
    if any(own[stage] != parked[stage] for stage in own.keys() & parked.keys()):
        raise Fenced(what, f"the follower caught up to {run.progress}, and its predecessor run {predecessor.id} is "
                     f"parked at {predecessor.progress}", "nothing to do: the follower ends, having written nothing; "
                     "the parked run takes its job back, and the next step starts another follower")


def _reached_first_follower_write(url: str, job: str, run_id: int) -> None:
    """The fault point of a follower handed its job, about to write for the first time (outside the lock)."""
    with session_scope(url) as s:
        row, run = s.get(Job, job), s.get(JobRun, run_id)
        first = (row is not None and row.current_run_id == run_id and run is not None
                 and run.following_since is not None and run.first_write_at is None)
    if first:
        faults.reached_in_job("follower.caught_up")  # mid cut-over: handed, nothing written yet


@contextmanager
def hold(url: str, job: str, run_id: int, stage: str, batch_id: int,
         give_up: threading.Event | None = None) -> Iterator[Held]:
    """A registry transaction holding the job row's lock, entered only by the job's current run, live. A primed
    follower's write waits, outside the lock, until it is handed the job (`awaiting_hand_over`), or `give_up`."""
    until = time.monotonic() + HAND_OVER_WAIT_SECONDS
    what = f"write of batch {batch_id} of stage {stage} of job {job} by run {run_id}"
    try:
        while True:
            if faults.enabled():
                _reached_first_follower_write(url, job, run_id)
            with session_scope(url) as s:
                bound_lock_waits(s)
                row = lock_row(s, Job, job)
                run = s.get(JobRun, run_id)
                waits = (row is not None and row.current_run_id != run_id and time.monotonic() < until
                         and not (give_up is not None and give_up.is_set()) and awaiting_hand_over(s, row, run))
                if not waits:
                    if row is None or row.current_run_id != run_id:
                        raise Fenced(what, f"run {row.current_run_id if row else None} is the job's current run now",
                                     "nothing to do: this run was superseded and stops; the current run writes "
                                     "instead")
                    if run is not None and run.ended_at is not None:
                        raise Fenced(what, f"the run is recorded as ended ({run.state}): the control plane "
                                     "declared it lost", "nothing to do: this run stops; the job goes on from its "
                                     "checkpoint under a new run")
                    if run is not None and run.first_write_at is None:
                        _require_at_the_park(s, run, what)
                        run.first_write_at = utcnow()
                    # a run made current before epochs were kept wrote with its id, which the migration made its
                    # epoch
                    yield Held(s, run.epoch if run is not None and run.epoch is not None else run_id)
                    return
            _wait_for_hand_over(url, job, run_id, until, give_up)
    except Fenced as refused:
        with session_scope(url) as s:
            audit.record(s, "sink.fenced", "job", job, outcome="refused", run=run_id, stage=stage,
                         batch=batch_id, reason=str(refused))
        raise
