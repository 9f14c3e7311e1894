"""The states the registry records, typed. Each is a StrEnum, so a value read back from the database (a plain
string) compares equal to its member."""

from __future__ import annotations

from enum import StrEnum


class RunState(StrEnum):
    """A job run's state."""

    SUBMITTED = "SUBMITTED"  # launched; its driver not yet heard of
    RUNNING = "RUNNING"
    PARKED = "PARKED"  # stopped at a batch boundary for a move; its driver lives, holding its lease
    STOPPED = "STOPPED"  # stopped at a batch boundary, and ended
    FINISHED = "FINISHED"
    FAILED = "FAILED"
    KILLED = "KILLED"  # its driver killed or lost: its checkpoint is whole as of its last commit
    STANDBY = "STANDBY"  # a warm successor waiting for its checkpoint: alive, but not the job's current run


LIVE = (RunState.SUBMITTED, RunState.RUNNING)
AT_A_BOUNDARY = (RunState.PARKED, RunState.STOPPED)  # stopped on a whole batch, its savepoint a `stop` one
PARKED_FORMS = AT_A_BOUNDARY  # with no end: a driver of a Changeover before PARKED parks as STOPPED


class Desired(StrEnum):
    """What is asked of a job."""

    RUN = "RUN"
    MOVE = "MOVE"  # stop at a boundary and park, for a successor elsewhere
    STOP = "STOP"  # stop at a boundary and end


class UpgradePhase(StrEnum):
    """A member's phase in a rolling upgrade (an upgrade's progress)."""

    PENDING = "PENDING"
    DRAINING = "DRAINING"
    UPGRADED = "UPGRADED"
    SKIPPED = "SKIPPED"  # left out, with the reason beside it (stopped by hand, its drain window closed)


class MemberStatus(StrEnum):
    """A member's status in a drain and an upgrade."""

    ACTIVE = "ACTIVE"
    DRAINING = "DRAINING"
    DRAINED = "DRAINED"
    UPGRADING = "UPGRADING"
    STOPPED = "STOPPED"  # its worker is down (stopped by hand, or the cluster is down)


class LightState(StrEnum):
    """A light job's state."""

    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    INTERRUPTED = "INTERRUPTED"  # interrupted by tag: a drain's shutdown timeout, a killed task, or the leak checker
