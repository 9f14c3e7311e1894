"""Why a run is launched, and what must still hold, under the job row's lock, for the launch to go ahead.

Each intent checks its own precondition against the job as the launch finds it once it holds the lock, so a late
orchestrator never fences a live run, never starts from a stale savepoint, and never starts two continuations.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import ClassVar

from sqlalchemy import select
from sqlalchemy.orm import Session

from changeover.errors import ChangeoverError
from changeover.handoff import lease
from changeover.registry.models import Job, JobRun, utcnow
from changeover.registry.records import LIVE, current_run
from changeover.registry.states import AT_A_BOUNDARY, Desired


@dataclass(frozen=True)
class Start:
    """A new owner with nothing to check about the run before it: a job's first run, a resume from a savepoint a
    user names, or a submit that goes on from the job's ended run (the launch's `copy_from` checks that run)."""

    makes_current: ClassVar[bool] = True

    def admit(self, s: Session, job: Job) -> None:
        return None


@dataclass(frozen=True)
class ReplaceParked:
    """The successor of a run parked for a move. Refused once that run has reclaimed the job (its lease ran out), or
    stopped again since (`park`, its park count then), or once the job is no longer asked to move (a user's stop or
    a withdrawn move that came after the park stands). Admitted, the parked run's lease counts from this launch:
    the successor's start is not charged to it."""

    run: int
    park: int | None = None
    makes_current: ClassVar[bool] = True

    def admit(self, s: Session, job: Job) -> None:
        before = current_run(s, job)
        if (job.current_run_id != self.run or job.desired != Desired.MOVE or before is None
                or before.state not in AT_A_BOUNDARY
                or (self.park is not None and before.parks != self.park)):
            raise ChangeoverError(f"launch of a successor to run {self.run} of job {job.name}",
                                  "that run is no longer stopped where its savepoint was taken (it resumed "
                                  "meanwhile, or stopped again), or the job is no longer asked to move (a user "
                                  "stopped it, or the move was withdrawn)", "retry the task: it looks at the job "
                                  "again")
        if before.parked:
            before.lease_until = utcnow() + timedelta(seconds=lease.length_of(job))


@dataclass(frozen=True)
class ContinueMove:
    """Goes on with the move of a run that ended on its way (killed before it parked). Refused if the job is no
    longer asked to move (someone cancelled or stopped it meanwhile) or another run took over."""

    run: int
    makes_current: ClassVar[bool] = True

    def admit(self, s: Session, job: Job) -> None:
        if job.desired != Desired.MOVE or job.current_run_id != self.run:
            raise ChangeoverError(f"launch of job {job.name} to continue its move", f"it is no longer asked "
                                  f"to move from run {self.run}: someone stopped it, or another run "
                                  "took over", "leave it as it is; retry the task to look at the job again")


@dataclass(frozen=True)
class ContinueRun:
    """Goes on from an ended run. Refused unless that run is still the job's current one, ended, and the job still
    wanted (desired RUN), so two continuations never both start."""

    run: int
    makes_current: ClassVar[bool] = True

    def admit(self, s: Session, job: Job) -> None:
        ended = current_run(s, job)
        if job.current_run_id != self.run or job.desired != Desired.RUN or ended is None or ended.ended_at is None:
            raise ChangeoverError(f"launch of job {job.name} to go on from run {self.run}",
                                  "that run is no longer the job's current, ended run, or the job was stopped",
                                  "leave it as it is: another launch went first, or someone stopped it")


@dataclass(frozen=True)
class Standby:
    """A warm standby for a live run (see `upgrade.warm`): it starts its session and its plans, and waits for its
    checkpoint, without becoming the job's current run. Refused unless that run is still the job's current,
    running one and has no other standby."""

    of: int
    makes_current: ClassVar[bool] = False

    def admit(self, s: Session, job: Job) -> None:
        standing = s.scalar(select(JobRun.id).where(JobRun.standby_of == self.of, JobRun.ended_at.is_(None)))
        running = current_run(s, job)
        if job.current_run_id != self.of or running is None or running.state not in LIVE or standing:
            raise ChangeoverError(f"launch of a warm standby for run {self.of} of job {job.name}",
                                  "that run is no longer the job's current, running one, or it has a standby "
                                  "already", "retry the task: it looks at the job again")


Intent = Start | ReplaceParked | ContinueMove | ContinueRun | Standby
START = Start()
