"""A drain's plan, as a pure function of what it observes: Jet's shutdown rules (`decide`) over the member's jobs
(`Observation`), made into what `drain.step` does next (`DrainPlan`). `drain.plan` observes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class DrainPlan:
    member: str
    status: str
    blocked_by: list[str] = field(default_factory=list)  # other members mid-upgrade: one at a time
    save: list[str] = field(default_factory=list)  # fault-tolerant and running: to be moved (warm where it can)
    warming: list[str] = field(default_factory=list)  # running while its successor starts or catches up
    stopping: list[str] = field(default_factory=list)  # asked to stop; the driver finishes its batch
    stopped: list[str] = field(default_factory=list)  # at a batch boundary: to be saved and resumed elsewhere
    wait: list[str] = field(default_factory=list)
    grace: dict[str, float] = field(default_factory=dict)  # job -> seconds left before cancel
    cancel: list[str] = field(default_factory=list)
    light: list[str] = field(default_factory=list)  # light jobs' tags among wait, grace and cancel
    handoff: list[str] = field(default_factory=list)  # moved, with the old run parked here until its successor writes
    decommissioned: bool = False
    executors: int = 0  # executors still on the decommissioned worker, within their grace
    executor_grace: float | None = None  # seconds left before the member's restart may end them
    executors_left: int = 0  # past their grace: the restart ends them, and their drivers rerun their tasks

    @property
    def jobs_left(self) -> bool:
        return bool(self.save or self.warming or self.stopping or self.stopped or self.wait or self.grace
                    or self.cancel or self.handoff)

    @property
    def done(self) -> bool:
        return self.status == "DRAINED"

    @property
    def actionable(self) -> bool:
        """Whether `step` has something to do now, as opposed to waiting."""
        if self.done:
            return True
        if self.blocked_by:
            return False
        if self.status == "ACTIVE" or self.save or self.stopped or self.cancel:
            return True
        if not self.stopping and not self.warming and not self.decommissioned:
            return True
        return not (self.warming or self.stopping or self.wait or self.grace or self.handoff or self.executors)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "done": self.done, "actionable": self.actionable}


@dataclass(frozen=True)
class JobObservation:
    """A job whose current run is on the member, as the drain's plan sees it."""
    name: str
    fault_tolerant: bool
    block_shutdown: bool
    shutdown_timeout: int
    live: bool  # its run is submitted or running
    asked_to_stop: bool  # asked to stop or to move: its driver finishes its batch
    warming: bool = False  # its successor starts, or follows it read-only, within its time
    light: bool = False  # a light job on the member's Connect server, named by its tag


@dataclass(frozen=True)
class Observation:
    """What draining a member waits for, observed: `decide` makes the plan of it."""
    member: str
    status: str
    busy_elsewhere: tuple[str, ...] = ()  # other members mid-upgrade
    jobs: tuple[JobObservation, ...] = ()
    draining_for: float = 0.0  # seconds since its drain began
    shutdown_cap: int | None = None  # caps each job's own shutdown timeout
    moving_off: frozenset[str] = frozenset()  # parked here until their successors write, or first batches pending
    decommissioned: bool = False
    executors: int = 0  # other members' executors still on its decommissioned worker
    executor_grace_left: float = 0.0


def decide(seen: Observation) -> DrainPlan:
    """Jet's shutdown rules over what the drain sees: fault-tolerant jobs are saved and moved, blockShutdown jobs
    waited for, any other waited for up to its shutdown timeout, then cancelled; one member at a time."""
    result = DrainPlan(member=seen.member, status=seen.status)
    if seen.status in ("DRAINED", "UPGRADING", "STOPPED"):
        result.status = "DRAINED" if seen.status != "STOPPED" else seen.status
        return result
    if seen.status == "ACTIVE" and seen.busy_elsewhere:
        result.blocked_by = list(seen.busy_elsewhere)
        return result
    for job in seen.jobs:
        if job.light:
            result.light.append(job.name)
        if job.fault_tolerant:
            if not job.live:
                result.stopped.append(job.name)
            elif job.asked_to_stop:
                result.stopping.append(job.name)
            else:
                (result.warming if job.warming else result.save).append(job.name)
        elif job.block_shutdown:
            result.wait.append(job.name)
        else:
            timeout = min(job.shutdown_timeout, seen.shutdown_cap if seen.shutdown_cap is not None else 1 << 30)
            left = timeout - seen.draining_for
            if left > 0:
                result.grace[job.name] = round(left, 1)
            else:
                result.cancel.append(job.name)
    if seen.status == "DRAINING":
        result.handoff = sorted(seen.moving_off - set(result.stopped) - set(result.stopping))
        result.decommissioned = seen.decommissioned
        if result.decommissioned and not result.jobs_left:
            if seen.executors and seen.executor_grace_left > 0:
                result.executors, result.executor_grace = seen.executors, round(seen.executor_grace_left, 1)
            else:
                result.executors_left = seen.executors
    return result
