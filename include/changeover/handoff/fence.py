"""The fence: a run writes only while it is its job's current run, decided under the job row's lock.

The lock is the one a launch takes to make a successor current and a parked run takes to reclaim its job,
so a write that passed the check lands before any of those, and a write after them is refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.orm import Session

from changeover import audit
from changeover.errors import ChangeoverError
from changeover.registry.db import bound_lock_waits, lock_row, session_scope
from changeover.registry.models import Job, JobRun, utcnow


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


@contextmanager
def hold(url: str, job: str, run_id: int, stage: str, batch_id: int) -> Iterator[Held]:
    """A registry transaction holding the job row's lock, entered only by the job's current run, live."""
    try:
        with session_scope(url) as s:
            bound_lock_waits(s)
            row = lock_row(s, Job, job)
            if row is None or row.current_run_id != run_id:
                raise Fenced(f"write of batch {batch_id} of stage {stage} of job {job} by run {run_id}",
                             f"run {row.current_run_id if row else None} is the job's current run now",
                             "nothing to do: this run was superseded and stops; the current run writes instead")
            run = s.get(JobRun, run_id)
            if run is not None and run.ended_at is not None:
                raise Fenced(f"write of batch {batch_id} of stage {stage} of job {job} by run {run_id}",
                             f"the run is recorded as ended ({run.state}): the control plane declared it lost",
                             "nothing to do: this run stops; the job goes on from its checkpoint under a new run")
            if run is not None and run.first_write_at is None:
                run.first_write_at = utcnow()
            # a run made current before epochs were kept wrote with its id, which the migration made its epoch
            yield Held(s, run.epoch if run is not None and run.epoch is not None else run_id)
    except Fenced as refused:
        with session_scope(url) as s:
            audit.record(s, "sink.fenced", "job", job, outcome="refused", run=run_id, stage=stage,
                         batch=batch_id, reason=str(refused))
        raise
