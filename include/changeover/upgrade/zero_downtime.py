"""Zero-downtime moves: the successor hydrates read-only, and takes over only once it has caught up.

A warm move's standby has its session and executors before the job stops, but restores the state and runs its first
batch only after. Here the ready standby is first given a checkpoint of its own, a `continue` savepoint of the live
run restored, and replays the live run's committed batches into Spark's noop sink (`runtime.follower`) while the live
run keeps writing. Once it is within `batches` of the live run on every stage, the move goes on as a warm move does:
the live run parks on its next whole batch, and the standby is handed the job (the fencing epoch rises), replays up to
that batch and writes from the next one. The cut-over's savepoint, for a rollback, is taken of the parked run after the
hand-over, off the job's downtime. A follower that has not caught up by its deadline is ended and its checkpoint
removed; the live run was never stopped.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select

from changeover import audit, savepoints
from changeover.cluster import Membership, wait_for
from changeover.errors import ChangeoverError
from changeover.jobs import dismiss_standby
from changeover.registry.db import lock_row, session_scope
from changeover.registry.models import Job, JobRun, UpgradeRun, utcnow
from changeover.runtime import checkpoints
from changeover.runtime.follower import lag, replayed_since
from changeover.settings import Settings
from changeover.timeutil import as_utc
from changeover.upgrade import lock, warm

MOVE_STRATEGIES = ("warm", "zero_downtime")
ENDED_DRIVER = ("FINISHED", "FAILED", "KILLED", "ERROR")


class CatchUpTimedOut(ChangeoverError):
    """A follower was aborted at its deadline: trying again at once would most likely time out again."""


@dataclass(frozen=True)
class CatchUp:
    """When a follower counts as caught up, and how long it has: within `batches` of the live run on every stage,
    having replayed `warm_batches` itself (its first replays compile the plan and load the state: a cut-over then
    would put them in the job's downtime)."""

    seconds: float = 300.0
    batches: int = 0
    warm_batches: int = 2


def record_for_upgrade(settings: Settings, upgrade_key: str, strategy: str | None, catch_up: CatchUp) -> None:
    """An upgrade's moves follow the strategy its run was triggered with (None: each job's option) and its catch-up:
    kept in its progress, once, for its drains and its trigger (the first try's choice stands for its retries)."""
    if strategy is not None:
        strategy_of(strategy, {})
    with session_scope(settings.database_url) as s:
        run = lock_row(s, UpgradeRun, lock.started(s, upgrade_key).id)
        progress = dict(run.progress or {})
        if "moves" in progress:
            return
        progress["moves"] = {"strategy": strategy, "catch_up_seconds": catch_up.seconds,
                             "catch_up_batches": catch_up.batches}
        run.progress = progress
        audit.record(s, "upgrade.moves", "upgrade", upgrade_key, **progress["moves"])


def for_upgrade(settings: Settings, upgrade_key: str | None) -> tuple[str | None, CatchUp]:
    """The move strategy an upgrade was triggered with (None: each job's own option), and its catch-up."""
    if upgrade_key is None:
        return None, CatchUp()
    with session_scope(settings.database_url) as s:
        run = s.scalar(select(UpgradeRun).where(UpgradeRun.key == upgrade_key))
        moves = dict(((run.progress or {}) if run is not None else {}).get("moves") or {})
    return moves.get("strategy"), CatchUp(float(moves.get("catch_up_seconds", CatchUp.seconds)),
                                          int(moves.get("catch_up_batches", CatchUp.batches)))


def strategy_of(asked: str | None, options: dict[str, Any]) -> str:
    """The move's strategy: the one asked for (a DAG's Param), else the job's option move_strategy, else warm."""
    chosen = asked or options.get("move_strategy") or "warm"
    if chosen not in MOVE_STRATEGIES:
        raise ChangeoverError(f"move strategy {chosen!r}", f"the strategies are {', '.join(MOVE_STRATEGIES)}",
                              "pick one of them (the DAG's strategy Param, or the job's option move_strategy)")
    return str(chosen)


@dataclass(frozen=True)
class Standing:
    """Where a follower stands against the live run, read from both checkpoints."""

    behind: dict[str, int]  # per stage, batches the live run has committed that the follower has not
    waited: float  # seconds since it began to follow
    caught_up: bool  # within `CatchUp.batches` on every stage, its own replays warm
    timed_out: bool  # not caught up, and past `CatchUp.seconds`


def standing(run: JobRun, follower: JobRun, catch_up: CatchUp) -> Standing:
    """Where `follower` (following since its `following_since`) stands against the live `run`."""
    assert run.checkpoint_root and follower.checkpoint_root and follower.following_since is not None
    stages = checkpoints.stage_names(Path(run.checkpoint_root))
    behind = lag(Path(run.checkpoint_root), Path(follower.checkpoint_root), stages)
    waited = (utcnow() - as_utc(follower.following_since)).total_seconds()
    replayed = replayed_since(Path(follower.checkpoint_root), stages, as_utc(follower.following_since).timestamp())
    # warm: its replays compiled the plans and loaded the state; a stage with no input meanwhile has none to replay
    level = all(n <= catch_up.batches for n in behind.values()) and max(replayed.values(), default=0) >= \
        catch_up.warm_batches
    return Standing(behind, waited, level, not level and waited >= catch_up.seconds)


def waiting_on_successor(settings: Settings, membership: Membership, run: JobRun, catch_up: CatchUp) -> bool:
    """Whether the run's move has nothing to do now but wait: its standby is starting within its time, or its follower
    replays behind the live run within its catch-up. A trigger waits this out instead of waking its task."""
    standby = warm.standby_of(settings, membership, run.id)
    if standby is None:
        return False
    if standby.following_since is None:
        return warm.warming(standby)  # ready, it is the step's to give it its checkpoint
    if not run.checkpoint_root or not standby.checkpoint_root:
        return False  # the step decides what is wrong
    try:
        now = standing(run, standby, catch_up)
    except OSError:  # a checkpoint removed under the poll (an abort): the step looks again
        return False
    return not now.caught_up and not now.timed_out


def caught_up(settings: Settings, membership: Membership, job_name: str, run: JobRun, standby: JobRun,
              reason: str, catch_up: CatchUp, upgrade_key: str | None = None) -> bool:
    """True once the ready standby follows the live run within `catch_up.batches` on every stage. The first call
    gives it its checkpoint. Past the deadline the follower is aborted and this raises: the live run never stopped."""
    if standby.following_since is None:
        name = f"{reason}-run{run.id}-follow{standby.id}"
        savepoints.take(settings, job_name, name, mode="continue", upgrade_key=upgrade_key, exist_ok=True)
        root = savepoints.restore(settings, job_name, name, follower=True)
        if not _start_following(settings, job_name, standby.id, root, name):
            shutil.rmtree(root, ignore_errors=True)
        return False
    now = standing(run, standby, catch_up)
    if now.caught_up:
        with session_scope(settings.database_url) as s:
            audit.record(s, "job.follow.caught_up", "job", job_name, run=standby.id, follows=run.id,
                         behind=now.behind, seconds=round(now.waited, 1))
        return True
    if not now.timed_out:
        return False
    why = (f"its follower run {standby.id} was still {now.behind} batch(es) behind the live run {run.id} after "
           f"{now.waited:.0f} s (it must be within {catch_up.batches})")
    abort(settings, membership, job_name, standby, why)
    raise CatchUpTimedOut(f"zero-downtime move of job {job_name}", f"{why}; the follower was ended and its "
                          f"checkpoint removed, and the job was never stopped: it runs on as run {run.id}",
                          "retry with a longer catch_up_seconds, give the target group more cores, or move it with "
                          "the warm strategy")


def _start_following(settings: Settings, job_name: str, standby_id: int, root: Path, savepoint: str) -> bool:
    """Give the standby its own checkpoint; False when it ended, or was given one, meanwhile."""
    with session_scope(settings.database_url) as s:
        lock_row(s, Job, job_name)
        standby = s.get(JobRun, standby_id)
        if standby is None or standby.ended_at is not None or standby.following_since is not None:
            return False
        standby.checkpoint_root, standby.following_since, standby.from_savepoint = str(root), utcnow(), savepoint
        audit.record(s, "job.follow.start", "job", job_name, run=standby_id, follows=standby.standby_of,
                     from_savepoint=savepoint, checkpoint=str(root))
        return True


def abort(settings: Settings, membership: Membership, job_name: str, standby: JobRun, why: str) -> None:
    """End a follower that will not be handed its job, wait for its driver to end, and remove its checkpoint."""
    if not dismiss_standby(settings, membership, standby.id, why):
        return  # handed the job meanwhile (another try's cut-over): its checkpoint is the job's now
    removed = standby.checkpoint_root if standby.submission_id is not None else None
    if standby.submission_id is not None:
        master = membership.master(standby.spark_version)
        wait_for(lambda: master.status(str(standby.submission_id)).state in ENDED_DRIVER, 120,
                 f"the driver of follower run {standby.id} ending")
    if removed:  # a driver whose submission is unknown may still write there: the leak checker's, then
        shutil.rmtree(removed, ignore_errors=True)
    with session_scope(settings.database_url) as s:
        audit.record(s, "job.move.zero_downtime.abort", "job", job_name, outcome="aborted", run=standby.id,
                     reason=why, checkpoint_removed=removed)


def cut_over_savepoint(settings: Settings, job_name: str, predecessor: JobRun, reason: str,
                       upgrade_key: str | None, name: str | None = None) -> str | None:
    """The savepoint of the run a follower replaced, at the batch it parked on: what a rollback resumes from. Taken
    after the hand-over, so the job's downtime does not wait on it; safe to repeat. None when that run is no longer
    at that boundary (it reclaimed the job: the follower ended before writing). name: instead of one made of
    `reason` (an update's own savepoint)."""
    if name is not None:  # named by its caller (an update's), not by the park: an earlier cut-over may hold it
        _drop_stale(settings, job_name, name, predecessor)
    name = name or f"{reason}-run{predecessor.id}-stop{predecessor.parks}"
    try:
        savepoints.take(settings, job_name, name, mode="stop", upgrade_key=upgrade_key, exist_ok=True,
                        of_run=predecessor.id)
    except ChangeoverError:
        with session_scope(settings.database_url) as s:
            run = s.get(JobRun, predecessor.id)
            if run is not None and run.parks == predecessor.parks and run.state in ("PARKED", "STOPPED"):
                raise
        return None
    return name


def _drop_stale(settings: Settings, job_name: str, name: str, predecessor: JobRun) -> None:
    """A savepoint of that name at another batch is an earlier cut-over's, whose follower failed before writing and
    whose run took the job back and wrote on: a rollback and a gate need this cut-over's batch."""
    with session_scope(settings.database_url) as s:
        row = savepoints.completed_in(s, job_name, name)
        stale = row is not None and (row.run_id != predecessor.id or not at_park(row.stages, predecessor))
    if stale:
        savepoints.delete(settings, job_name, name)


def at_park(stages: dict[str, int | None] | None, parked: JobRun) -> bool:
    """Whether a savepoint's batches are the ones the run parked on (stages that never committed aside)."""
    def committed(batches: dict[str, int | None] | None) -> dict[str, int]:
        return {stage: batch for stage, batch in (batches or {}).items() if batch is not None}
    return committed(stages) == committed(parked.progress)
