"""The runtime wrapper that runs inside the Spark driver.

It checks the Spark version it was launched for before anything runs, runs each stage as one long-lived
query, reports heartbeats and committed batches to the registry, and stops at a batch boundary when asked:
a user's stop ends the run, a move parks it until its successor takes over (see `changeover.handoff.lease`).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import runpy
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from sqlalchemy import update

from changeover import audit, faults
from changeover.compat import plan
from changeover.handoff import lease
from changeover.registry import db
from changeover.registry.db import TRANSIENT, lock_row, patiently, refused, session_scope
from changeover.registry.models import Job, JobRun, utcnow
from changeover.registry.states import LIVE, Desired, RunState
from changeover.runtime import checkpoints, state_partitions
from changeover.runtime.contract import JobContext, Stage
from changeover.runtime.follower import CannotFollow, Follower, InQueryReplay, PlannedPast, Withdrawn
from changeover.runtime.queries import StageQueries
from changeover.settings import Settings
from changeover.timeutil import as_utc

log = logging.getLogger("changeover.driver")
T = TypeVar("T")
LOOP_SECONDS = 0.2
ENTRIES = ("build", "run", "script")
STANDBY_POLL_SECONDS = 0.05  # how often a ready standby looks for its checkpoint: the move's downtime waits on it
PRIME_POLL_SECONDS = 0.02  # how often a priming follower looks for its predecessor's park: the downtime waits on it
PRIME_CHECK_SECONDS = 0.5  # and how often it heartbeats and looks whether the cut-over still comes
STANDBY_WAIT_SECONDS = 1800.0  # a standby never handed its job leaves by itself
WARM_UP_SECONDS = 120.0


def unmatched_state(job: str, restored: set[str], stages: set[str]) -> str | None:
    """Seed 002's rules: a new stage starts empty, a matching one is restored, and state of a stage the
    job no longer has is an error unless allow_non_restored_state is given (as in Flink)."""
    orphaned = sorted(restored - stages)
    if not orphaned:
        return None
    return (
        f"job {job}: refused to start: the savepoint holds state of stage(s) {', '.join(orphaned)}, "
        f"which the job no longer has (its stages: {', '.join(sorted(stages))}). "
        "Resume with --allow-non-restored-state to drop that state, or --rename-stage OLD=NEW to move it."
    )


def jvm_lost(exc: BaseException, parent_at_start: int, wait: float = 2.0) -> bool:
    """Whether the driver's JVM is gone under its Python (killed, the OOM killer), rather than the job's own code
    having failed: this process lost the parent that started it. A py4j error is how the loss shows (a reset
    socket surfaces as a bare Py4JError), and the kernel may close the JVM's sockets a moment before it re-parents
    its children, so the parent is looked at again for up to `wait` s. Such a run ends KILLED, and a move goes
    on from its checkpoint, as after any other kill."""
    from py4j.protocol import Py4JError

    if not _caused_by(exc, Py4JError):
        return False  # not a failure to reach the JVM: the job's own (its code's sockets included)
    deadline = time.monotonic() + wait
    while os.getppid() == parent_at_start:
        if time.monotonic() >= deadline:
            return False  # the JVM is alive: a py4j error it raised is about the job
        time.sleep(0.1)
    return True


def _caused_by(exc: BaseException, kind: type[BaseException]) -> bool:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, kind):
            return True
        seen.add(id(current))
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return False


def version_mismatch(job: str, actual: str, expected: str) -> str:
    return (
        f"job {job}: refused to start on Spark {actual}: it was launched for the {expected} version group "
        f"and Spark needs driver and executors at exactly one version. "
        f"Relaunch it on the {expected} group, or resume it from a savepoint on the {actual} group."
    )


class Superseded(Exception):
    """A follower's cut-over ended before it wrote anything: the parked run took its job back, or the move was
    withdrawn."""


@dataclass(frozen=True)
class Handed:
    """What a standby was handed: the checkpoint it runs from, its stages' plans, and its queries when a follower
    started them before the hand-over (`Driver._prime`)."""

    root: Path
    plans: dict[str, Any] | None
    queries: StageQueries | None = None


class GaveUp(Exception):
    """A parked or stood-down run ended itself: its registry refuses it, or has not answered for its whole patience.
    Not the job's failure: its queries are stopped, its checkpoint's last commit is a whole batch, and the job goes
    on from it."""


class Driver:
    def __init__(self, settings: Settings, job: str, run_id: int, lease_seconds: float | None = None,
                 stop_deadline: float = 60.0, self_fence_seconds: float | None = None) -> None:
        self.settings = settings
        self.lease_seconds = lease_seconds if lease_seconds is not None else lease.lease_seconds()
        self.stop_deadline = stop_deadline
        self.self_fence_seconds = self_fence_seconds if self_fence_seconds is not None else lease.self_fence_seconds()
        self.url = settings.database_url
        self.job = job
        self.run_id = run_id
        self._unanswered_since: float | None = None  # when the parked run's registry calls began to fail
        self._queries: StageQueries | None = None  # the running loop's, for standing down
        self._confirmed_at = time.monotonic()  # when the registry last said this run is its job's current one
        self._stood_down_at: float | None = None
        self._checkpoint_root: Path | None = None
        self._beaten = 0.0  # when a cut-over's step last heartbeat
        self._in_query_replay: InQueryReplay | None = None  # a follower's queries primed in place: on every start

    def record_submission(self, cwd: Path) -> None:
        """The second half of a launch whose answer was lost (its task killed after the master accepted it):
        a worker runs each driver in a folder named by its submission id, so the driver can name it itself."""
        if not cwd.name.startswith("driver-"):
            return
        with session_scope(self.url) as s:
            run = s.get(JobRun, self.run_id)
            if run is not None and run.submission_id is None:
                run.submission_id = cwd.name
                audit.record(s, "job.submission_reconciled", "job", self.job, run=self.run_id, submission=cwd.name)

    def heartbeat(self) -> bool:
        """False when the run has ended already (e.g. recorded as never accepted before this driver started)."""
        with session_scope(self.url) as s:
            # conditional, against the control plane ending a run it never heard of (`jobs._unaccepted`)
            return bool(s.execute(update(JobRun).where(JobRun.id == self.run_id, JobRun.ended_at.is_(None))
                                  .values(heartbeat_at=utcnow())).rowcount)

    def fail(self, message: str) -> None:
        with session_scope(self.url) as s:
            run = s.get(JobRun, self.run_id)
            if run and run.ended_at is None:  # not a run already ended, e.g. cancelled, whose driver dies now
                run.state, run.error, run.ended_at = "FAILED", message, utcnow()
            audit.record(s, "job.fail", "job", self.job, outcome="failed", run=self.run_id, error=message)

    def lost_jvm(self, message: str) -> None:
        with session_scope(self.url) as s:
            run = s.get(JobRun, self.run_id)
            if run and run.ended_at is None:
                run.state, run.error, run.ended_at = "KILLED", message, utcnow()
            audit.record(s, "job.end", "job", self.job, outcome="killed", run=self.run_id, state="KILLED",
                         reason=message)

    def options(self) -> dict[str, Any]:
        with session_scope(self.url) as s:
            job = s.get(Job, self.job)
            return dict(job.options) if job else {}

    @property
    def registry(self) -> str:
        return f"job {self.job} run {self.run_id}: the registry"

    def stop_state(self) -> str:
        """"fenced" once another run is the job's current one, or this run is recorded as ended (the control plane
        declared it lost), else the job's desired state: RUN, STOP or MOVE."""
        with session_scope(self.url) as s:
            job = s.get(Job, self.job)
            run = s.get(JobRun, self.run_id)
            if job is None or job.current_run_id != self.run_id or run is None or run.ended_at is not None:
                return "fenced"
            return job.desired

    def report(self, progress: dict[str, int | None], committed: bool, state: str = "RUNNING",
               **fields: Any) -> None:
        with session_scope(self.url) as s:
            run = s.get(JobRun, self.run_id)
            assert run is not None
            now = utcnow()
            run.heartbeat_at, run.progress = now, dict(progress)
            for name, value in fields.items():
                setattr(run, name, value)
            if run.state in LIVE or (run.state == RunState.PARKED and state == RunState.STOPPED):
                run.state = state
            if committed:
                run.last_commit_at = now
                run.first_commit_at = run.first_commit_at or now
            if state != "RUNNING":
                run.ended_at = now
                audit.record(s, "job.stop", "job", self.job, run=self.run_id, state=state, progress=progress)

    def seconds_since_launch(self) -> float:
        with session_scope(self.url) as s:
            run = s.get(JobRun, self.run_id)
            assert run is not None
            return (utcnow() - as_utc(run.submitted_at)).total_seconds()

    def mark_first_trigger(self) -> None:
        """Every query has finished a trigger since the start: a drain holding its member's restart for this
        run's first batch can stop waiting, whether that batch had input or found none."""
        with session_scope(self.url) as s:
            s.execute(update(JobRun).where(JobRun.id == self.run_id, JobRun.first_trigger_at.is_(None))
                      .values(first_trigger_at=utcnow()))

    def report_operators(self, spark: Any, checkpoint_root: Path, stages: list[str]) -> None:
        """Record each stage's stateful operators as Spark's `state-metadata` reader sees them.

        Read once a stage has committed a batch (the reader needs one), so a savepoint's manifest
        can say which operators its state belongs to without starting Spark itself.
        """
        found: dict[str, Any] = {}
        for stage in stages:
            if not (checkpoint_root / stage / "state").is_dir():
                found[stage] = []  # a stateless stage
                continue
            rows = spark.read.format("state-metadata").load(str(checkpoint_root / stage)).collect()
            found[stage] = [row.asDict(recursive=True) for row in rows]
        with session_scope(self.url) as s:
            run = s.get(JobRun, self.run_id)
            assert run is not None
            run.operators = {**(run.operators or {}), **found}

    def describe(self, spark: Any, stages: list[Stage]) -> dict[str, Any] | None:
        """The stages' stateful plans for later savepoints' manifests. A plan Changeover cannot read costs the
        compatibility check detail (it falls back to the state schemas), never the job."""
        if spark is None:
            return None
        try:
            return plan.describe_stages(spark, stages)
        except Exception as exc:  # noqa: BLE001 - py4j surfaces JVM errors of any kind
            log.warning("job %s run %s: its stage plans were not recorded (%s)", self.job, self.run_id, exc)
            return None

    def rescale(self, spark: Any, checkpoint_root: Path, count: int, stages: list[str]) -> None:
        """Repartition the state of each restored stage the job builds to `count` partitions before any query
        starts: this run's own checkpoint, laid out from a savepoint that stays as it was. A failure fails the run;
        the job resumes from the savepoint again, or a run continuing this one finishes the repartition. No
        savepoint is taken of the root meanwhile (the marker)."""
        marker = checkpoint_root / state_partitions.RESCALING
        marker.touch()
        for stage in [name for name in stages if (checkpoint_root / name).is_dir()]:
            started = time.monotonic()
            moved = state_partitions.rescale(spark, checkpoint_root / stage, count)
            if moved is None:
                continue
            before, batch = moved
            seconds = round(time.monotonic() - started, 2)
            log.info("job %s run %s: stage %s state %s -> %s partitions (batch %s, %.1f s)", self.job, self.run_id,
                     stage, before, count, batch, seconds)
            patiently(partial(self._record_rescale, stage, before, count, batch, seconds), self.registry)
            faults.reached_in_job("rescale.stage_done", stage)
        marker.unlink()

    def _record_rescale(self, stage: str, before: int, count: int, batch: int, seconds: float) -> None:
        with session_scope(self.url) as s:
            audit.record(s, "job.rescale", "job", self.job, run=self.run_id, stage=stage, partitions_before=before,
                         partitions=count, batch=batch, seconds=seconds)

    def stop_failed(self, wanted: str) -> None:
        """Past the hard deadline a trigger was still active: the stop is withdrawn and the job runs on."""
        with session_scope(self.url) as s:
            job = lock_row(s, Job, self.job)
            if job is not None and job.current_run_id == self.run_id and job.desired == wanted:
                job.desired = Desired.RUN
            run = s.get(JobRun, self.run_id)
            if run is not None:
                run.stopping_after = None  # its follower must not take the batch it named for its last
            audit.record(s, "job.stop_failed", "job", self.job, outcome="failed", run=self.run_id,
                         reason=f"a batch was still running {self.stop_deadline:.0f} s after the stop began to wait "
                         "for it; the job keeps running")

    def await_handoff(self, spark: Any, stages: list[Stage]) -> Handed | None:
        """A warm standby: with the job built, warm the executors and the streaming engine, say so, then wait for
        the predecessor's checkpoint, following it read-only meanwhile when given a checkpoint of its own. A
        follower whose predecessor is stopping for the move starts the job's queries before it is handed the job
        (`_prime`).
        Returns what it was handed, or None when dismissed: then it has written nothing."""
        # the orchestrator's deadline runs from the launch, so this one does too: the session's start counts
        if not warm_up(spark, lease.STANDBY_READY_SECONDS - patiently(self.seconds_since_launch, self.registry)):
            patiently(partial(lease.end_standby, self.url, self.job, self.run_id, "not ready within "
                              f"{lease.STANDBY_READY_SECONDS:.0f} s of its launch: no executor ran its warm-up"),
                      self.registry)
            return None
        plans = self.describe(spark, stages)
        if not patiently(partial(lease.mark_ready, self.url, self.run_id, plans), self.registry):
            return None
        log.info("job %s run %s: ready, waiting for its checkpoint", self.job, self.run_id)
        deadline = time.monotonic() + STANDBY_WAIT_SECONDS
        beat = time.monotonic()
        look = partial(lease.standby_turn, self.url, self.job, self.run_id)
        follower: Follower | None = None
        primed: StageQueries | None = None
        unprimable = False
        while (turn := patiently(look, self.registry)) in ("wait", "follow", "cut_over"):
            if turn != "wait" and follower is None and (roots := patiently(partial(lease.followed, self.url,
                                                                                   self.run_id), self.registry)):
                follower = Follower(spark, stages, *roots, self._leader_stopped)
            if primed is not None and follower is not None and turn != "cut_over":
                return self._unprime(primed, follower, plans, "its predecessor took the job back, or the move was "
                                     "withdrawn, after it had started its queries")
            if turn == "cut_over" and follower is not None and primed is None and not unprimable:
                if unmatched_state(self.job, set(checkpoints.stage_names(follower.root)), {s.name for s in stages}):
                    unprimable = True  # its stages are decided once it is handed the job (`run_streaming`)
                elif (primed := self._prime(follower, stages)) is None:
                    continue  # the cut-over ended before the park: it follows on
            if primed is not None and follower is not None and (failure := primed.failure()) is not None:
                return self._unprime(primed, follower, plans, f"its queries failed before the hand-over ({failure})")
            # a follower that cannot prime follows on through the cut-over: less to replay once it is handed the job
            if (turn == "follow" or unprimable) and follower is not None and self._follow(follower):
                beat = time.monotonic()
                continue
            if time.monotonic() >= deadline:
                patiently(partial(lease.end_standby, self.url, self.job, self.run_id, f"not handed its job within "
                                  f"{STANDBY_WAIT_SECONDS:.0f} s of being ready"), self.registry)
                continue  # ended, or handed the job just before: the next look says which
            if time.monotonic() - beat >= lease.HEARTBEAT_SECONDS:
                patiently(self.heartbeat, self.registry)
                beat = time.monotonic()
            time.sleep(STANDBY_POLL_SECONDS)
        if turn == "dismissed":
            ended = patiently(partial(lease.end_standby, self.url, self.job, self.run_id, "dismissed: the run it was "
                                      "to succeed is no longer the job's, or its move was withdrawn"), self.registry)
            if ended or patiently(look, self.registry) != "start":  # not ended: handed the job just before
                if primed is not None and follower is not None:
                    primed.stand_down_now()
                    shutil.rmtree(follower.root, ignore_errors=True)  # may hold a batch it planned alone
                return None
        if primed is None and follower is None and (roots := patiently(partial(lease.followed, self.url,
                                                                               self.run_id), self.registry)):
            follower = Follower(spark, stages, *roots, self._leader_stopped)  # handed the job before it looked
        if primed is None and follower is not None:
            began = time.monotonic()
            try:
                at = follower.finish(self._still_handed)
            except Superseded:
                why = "the parked run took its job back while it caught up: it ends, having written nothing"
                log.warning("job %s run %s: %s", self.job, self.run_id, why)
                self._end_follower(follower, why)
                return None
            patiently(partial(lease.report_following, self.url, self.run_id, at), self.registry)  # see `fence`
            log.info("job %s run %s: handed the job, caught up to %s in %.2f s", self.job, self.run_id, at,
                     time.monotonic() - began)
            self._record_level(at, "after_hand_over", began)
            faults.reached_in_job("follower.caught_up")  # mid cut-over: current, nothing written yet
        with session_scope(self.url) as s:
            run = s.get(JobRun, self.run_id)
            assert run is not None and run.checkpoint_root
            return Handed(Path(run.checkpoint_root), plans, primed)

    def _prime(self, follower: Follower, stages: list[Stage]) -> StageQueries | None:
        """The predecessor is stopping for the move: replay up to the batch it said it stops after (it names it once
        that batch has begun), wait for it to park, take the batch it planned next if any, and start the job's queries
        on the follower's checkpoint with the job's own sinks, before the hand-over. Their first write waits for it
        inside the fence (`fence.awaiting_hand_over`), so the queries' start and their first batch overlap the
        hand-over instead of following it. None, having started nothing, when the cut-over ended first: the follower
        follows on."""
        began = time.monotonic()
        through = patiently(partial(lease.stopping_after, self.url, self.run_id), self.registry)
        try:
            if through is not None and (queries := self._prime_in_queries(follower, stages, through)) is not None:
                return queries
            while follower.step(through):
                self._still_cutting_over()
            checked = time.monotonic()
            while not self._leader_stopped():
                if time.monotonic() - checked >= PRIME_CHECK_SECONDS:
                    self._still_cutting_over()
                    checked = time.monotonic()
                time.sleep(PRIME_POLL_SECONDS)
            self._still_cutting_over()
            at = follower.finish(self._still_cutting_over)
        except Superseded:
            log.info("job %s run %s: its predecessor's stop ended before it parked for the hand-over; following on",
                     self.job, self.run_id)
            return None
        except CannotFollow as exc:
            self._end_follower(follower, str(exc))
            return None
        # its first write must come from the batch the predecessor parked at (`fence`): said before any write
        patiently(partial(lease.report_following, self.url, self.run_id, at), self.registry)
        queries = StageQueries(stages, follower.root, self.url, self.job, self.run_id)
        self._queries = queries  # stood down, should the driver fail before its hand-over (`main`)
        queries.start()
        log.info("job %s run %s: caught up at %s (its predecessor said it stops after %s) in %.2f s; its queries "
                 "started, their writes waiting for the hand-over", self.job, self.run_id, at, through,
                 time.monotonic() - began)
        self._record_level(at, "after_park", began)
        return queries

    def _prime_in_queries(self, follower: Follower, stages: list[Stage],
                          through: dict[str, int]) -> StageQueries | None:
        """A follower one batch short of its predecessor's last starts the job's queries there, on that batch's
        offsets, beside the predecessor running it (`InQueryReplay`): they run it without writing, say the follower is
        level once the predecessor has parked after it, commit it, and then plan the next batch themselves, warm.
        Returns them once they have committed it (a commit the driver does not count as its own: `started_from`), or
        failed (the caller ends the standby). None, having stopped them unwritten, when the predecessor logged a batch
        past its last or stopped without committing it (it primes as before), or when the follower is not one batch
        short; raises Superseded, having stopped them, when the cut-over ended."""
        began = time.monotonic()
        one_short = {stage: batch - 1 for stage, batch in through.items()}
        while follower.step(one_short):
            self._still_cutting_over()
        if not follower.level_short_of(through):
            return None
        for stage in through:
            follower.take_batch(stage, through[stage])
        report = partial(lease.report_following, self.url, self.run_id, dict(through))
        hook = InQueryReplay(follower, through, lambda: patiently(report, self.registry), self._still_cutting_over)
        queries = StageQueries(stages, follower.root, self.url, self.job, self.run_id, replay=hook)
        self._queries, self._in_query_replay = queries, hook  # stood down, should the driver fail (`main`)
        try:
            queries.start()
            checked = time.monotonic()
            while not (hook.levelled.is_set() and follower.committed() == through):
                if queries.failure() is not None:
                    if isinstance(hook.raised, Superseded):
                        raise hook.raised
                    if isinstance(hook.raised, (PlannedPast, Withdrawn)):
                        log.info("job %s run %s: %s; it primes from its predecessor's checkpoint", self.job,
                                 self.run_id, hook.raised)
                        self._stop_primed(queries)
                        return None
                    return queries
                if time.monotonic() - checked >= PRIME_CHECK_SECONDS:
                    self._still_cutting_over()
                    checked = time.monotonic()
                hook.levelled.wait(PRIME_POLL_SECONDS)
        except BaseException as exc:
            self._stop_primed(queries)
            if isinstance(exc, Superseded) and follower.committed() != one_short:
                # committed the last batch, and may have begun to plan the next alone: it cannot follow on
                raise CannotFollow(f"following job {self.job} on after its cut-over ended", "its queries had "
                                   f"committed its predecessor's last batch {through}", "nothing to do: it ends, "
                                   "having written nothing; the next step starts another follower") from exc
            raise
        log.info("job %s run %s: level at %s, its predecessor's last batch, in its own queries in %.2f s; their "
                 "next write waits for the hand-over", self.job, self.run_id, through, time.monotonic() - began)
        self._record_level(dict(through), "in_queries", began)
        return queries

    def _record_level(self, at: dict[str, int | None], how: str, began: float) -> None:
        """Off the cut-over's path (its queries run, or it is handed the job), and best effort: the audit's line."""
        try:
            lease.record_level(self.url, self.job, self.run_id, at, how, time.monotonic() - began)
        except TRANSIENT as exc:
            log.warning("job %s run %s: its level at %s was not recorded (%s)", self.job, self.run_id, at, exc)

    def _stop_primed(self, queries: StageQueries) -> None:
        """Queries primed in place that wrote nothing, stood down: their write hook's wait on the predecessor ends
        first, and so does a write waiting in the fence (none should: no stage commits the last batch unless all
        do)."""
        queries.stand_down_now()
        self._queries = self._in_query_replay = None

    def _still_cutting_over(self) -> None:
        """Between the cut-over's steps: heartbeat, and stop when the hand-over is no longer coming (`Superseded`)."""
        if time.monotonic() - self._beaten >= lease.HEARTBEAT_SECONDS:
            patiently(self.heartbeat, self.registry)
            self._beaten = time.monotonic()
        if patiently(partial(lease.standby_turn, self.url, self.job, self.run_id), self.registry) not in (
                "cut_over", "start"):
            raise Superseded(self.job)

    def _unprime(self, queries: StageQueries, follower: Follower, plans: dict[str, Any] | None,
                 why: str) -> Handed | None:
        """A follower whose queries started before its hand-over, and whose cut-over ended without one: it ends,
        having written nothing (its checkpoint may hold a batch its queries planned alone, so it cannot follow on; a
        later step starts another). Ended first, so that a write waiting for the hand-over is refused; then its
        queries stop. Handed the job just before, it goes on with its queries started again."""
        why = f"{why}: it ends, having written nothing"
        ended = patiently(partial(lease.end_standby, self.url, self.job, self.run_id, why), self.registry)
        queries.stand_down_now()
        if not ended and patiently(partial(lease.standby_turn, self.url, self.job, self.run_id),
                                   self.registry) == "start":
            log.info("job %s run %s: handed the job as its cut-over ended; its queries start again", self.job,
                     self.run_id)
            return Handed(follower.root, plans, None)
        log.warning("job %s run %s: %s", self.job, self.run_id, why)
        shutil.rmtree(follower.root, ignore_errors=True)  # its queries are stopped; nobody else's
        return None

    def _end_follower(self, follower: Follower, why: str) -> None:
        """A follower that leaves by itself, having written nothing and with none of its queries running: ended, then
        its checkpoint removed (nobody else's; an abort that finds it ended removes nothing). Handed the job or ended
        meanwhile, it keeps it."""
        if patiently(partial(lease.end_standby, self.url, self.job, self.run_id, why), self.registry):
            shutil.rmtree(follower.root, ignore_errors=True)

    def _leader_stopped(self) -> bool:
        return patiently(partial(lease.predecessor_stopped, self.url, self.run_id), self.registry)

    def _still_handed(self) -> None:
        """Between the cut-over's replays: heartbeat, and stop chasing a parked run that took its job back."""
        patiently(self.heartbeat, self.registry)
        if patiently(self.stop_state, self.registry) == "fenced":
            raise Superseded(self.job)

    def _follow(self, follower: Follower) -> bool:
        """One step of a read-only follower; True when it replayed a batch (and said so). A follower that cannot go
        on ends itself: the job was never stopped for it, and the orchestrator moves it another way. While the
        predecessor is asked to move, it replays only what the predecessor has committed: the batch it runs may be its
        last, which the job's own queries run instead (`_prime_in_queries`)."""
        def not_moving() -> bool:
            return not patiently(partial(lease.predecessor_moving, self.url, self.run_id), self.registry)
        try:
            replayed = follower.step(running_too=not_moving)
        except CannotFollow as exc:
            self._end_follower(follower, str(exc))
            return False
        if replayed:
            patiently(partial(lease.report_following, self.url, self.run_id, follower.committed()), self.registry)
        return replayed

    def run_streaming(self, stages: list[Stage], checkpoint_root: Path, allow_non_restored: bool = False,
                      spark: Any = None, plans: dict[str, Any] | None = None,
                      started: StageQueries | None = None) -> bool:
        """Run until stopped or handed off (`started`: the queries a follower started before its hand-over). False
        when the restored state does not fit the job's stages, or when it cannot resume where it parked."""
        names = [stage.name for stage in stages]
        if len(set(names)) != len(names):
            raise ValueError(f"job {self.job}: stage names must be unique, got {names}")
        restored = set(checkpoints.stage_names(checkpoint_root))
        refusal = unmatched_state(self.job, restored, set(names))
        if refusal and not allow_non_restored:
            print(refusal, file=sys.stderr, flush=True)
            self.fail(refusal)
            return False
        for orphan in restored - set(names):  # allowed: set aside, so later savepoints do not carry it
            (checkpoint_root / orphan).rename(checkpoint_root / f".dropped-{orphan}")
        # on the follower's checkpoint, its predecessor's batches never reach the sinks again (`InQueryReplay`), nor
        # count as this run's own commits
        queries = started or StageQueries(stages, checkpoint_root, self.url, self.job, self.run_id,
                                          replay=self._in_query_replay)
        seen = queries.started_from if started is not None else queries.position()  # its first commit is reported
        described_plans = plans if plans is not None else self.describe(spark, stages)
        patiently(partial(self.report, seen, committed=False, sinks={s.name: s.sink.describe() for s in stages},
                          plans=described_plans), self.registry)
        took_over = False
        if started is None:
            queries.start()
        self._queries, self._checkpoint_root, self._confirmed_at = queries, checkpoint_root, time.monotonic()
        triggered = False
        described: set[str] = set()
        reported = time.monotonic()
        while True:
            state = self.confirm(queries)
            if state == "fenced":
                queries.stop_now()
                self.report(queries.committed(), committed=False, state="STOPPED")
                return True
            if state in ("STOP", "MOVE"):
                announce = self._announce_last_batch if state == "MOVE" else None
                followed = state == "MOVE" and self._patiently(partial(lease.is_followed, self.url, self.run_id))
                if not queries.stop_at_boundary(self.stop_deadline, after_commit=state == "MOVE", on_last=announce,
                                                fresh=followed):
                    self._patiently(partial(self.stop_failed, state))
                    continue
                now = queries.committed()
                self._patiently(partial(self.report, now, committed=now != seen))
                seen = now
                if state == "STOP" or not self._park(now, checkpoint_root):
                    if state == "STOP":
                        self._patiently(partial(self.report, now, committed=False, state="STOPPED"))
                    return True
                queries.start()
                self._confirmed_at = time.monotonic()  # the lease's decision to resume said it is current
                continue
            failure = queries.failure()
            if failure is not None:
                if self._patiently(self.stop_state) == "fenced":
                    continue  # a fenced write failed its batch: nothing of it landed; the next turn stops
                raise failure
            now = queries.committed()
            advanced = now != seen
            if not (triggered and took_over) and (advanced or queries.have_run()):
                if not triggered:
                    self._patiently(self.mark_first_trigger)
                    triggered = True
                if not took_over:
                    took_over = self._patiently(partial(lease.take_over, self.url, self.job, self.run_id))
            fresh = [n for n in names if n not in described and now[n] is not None]
            if spark is not None and fresh:
                self._patiently(partial(self.report_operators, spark, checkpoint_root, fresh))
                described.update(fresh)
            if advanced or time.monotonic() - reported >= lease.HEARTBEAT_SECONDS:
                try:
                    self.report(now, committed=advanced)
                    seen, reported = now, time.monotonic()
                except TRANSIENT as exc:  # SQLite busy past its timeout, a restarting server: the queries go on
                    log.warning("job %s run %s: progress not recorded (%s); retrying", self.job, self.run_id, exc)
            time.sleep(LOOP_SECONDS)

    def _announce_last_batch(self, batches: dict[str, int]) -> None:
        """Best effort: unsaid, the follower replays only committed batches until this run has parked, and starts its
        queries later."""
        try:
            lease.announce_last_batch(self.url, self.run_id, batches)
        except Exception as exc:  # noqa: BLE001 - the stop goes on whatever the registry said
            log.warning("job %s run %s: the batch it stops after was not recorded (%s)", self.job, self.run_id, exc)

    def _patiently(self, call: Callable[[], T]) -> T:
        """A registry call of the running loop, waited for while the registry does not answer. Every sink's write
        waits for the registry inside the fence meanwhile, so none lands unconfirmed; past `self_fence_seconds`
        the driver stands down (`fence_self`). A driver that stood down ends itself when the registry refuses it or
        has not answered for its whole patience: the job goes on from its checkpoint."""
        try:
            return patiently(call, self.registry, while_waiting=self.fence_self)
        except TRANSIENT as exc:
            if self._stood_down_at is None or self._checkpoint_root is None:
                raise
            self._give_up(self._checkpoint_root, exc, f"stood down, it ended after "
                          f"{time.monotonic() - self._confirmed_at:.0f} s without confirming that it is its job's "
                          "current run")

    def confirm(self, queries: StageQueries) -> str:
        """`stop_state`, waited for. A run that stood down starts its queries again once the registry says it is
        still its job's current one and should run (its batches replay from the last commit)."""
        state = self._patiently(self.stop_state)
        self._confirmed_at = time.monotonic()
        if self._stood_down_at is not None:
            seconds, self._stood_down_at = time.monotonic() - self._stood_down_at, None
            if state == "RUN":
                queries.start()
            self.record_stand_down(seconds, state)
        return state

    def fence_self(self, waited_for: BaseException) -> None:
        """Between the running loop's retries: past `self_fence_seconds` without confirming that this run is its
        job's current one, because the registry does not answer (not a lock or a conflict, which it answers with),
        stop its queries, a batch waiting inside its write included, before the control plane may record the run
        lost for its silence and let a successor write."""
        queries = self._queries
        if queries is None or not queries.queries or self._stood_down_at is not None or not db.away(waited_for):
            return
        unconfirmed = time.monotonic() - self._confirmed_at
        if unconfirmed < self.self_fence_seconds:
            return
        self._stood_down_at = time.monotonic()
        stopped = queries.stand_down_now()
        log.error("job %s run %s: not confirmed as its job's current run for %.0f s (the registry does not answer): "
                  "stopped its queries %s until it is", self.job, self.run_id, unconfirmed, stopped)

    def stand_down_queries(self) -> None:
        if self._in_query_replay is not None:  # a write hook waiting on the predecessor ends first
            self._in_query_replay.cancelled.set()
        if self._queries is not None:
            self._queries.stand_down.set()

    def record_stand_down(self, seconds: float, state: str) -> None:
        """Best effort: the registry that just answered may be gone again, and the queries run meanwhile."""
        then = {"RUN": "resumed", "fenced": "stopped"}.get(state, state.lower())
        stages = [stage.name for stage in (self._queries.stages if self._queries else [])]
        log.info("job %s run %s: confirmed after standing down %.0f s; %s", self.job, self.run_id, seconds, then)
        try:
            with session_scope(self.url) as s:
                audit.record(s, "job.self_fenced", "job", self.job, outcome="ok", run=self.run_id, stages=stages,
                             seconds=round(seconds, 1), then=then)
        except TRANSIENT as exc:
            log.warning("job %s run %s: its stand-down was not recorded (%s)", self.job, self.run_id, exc)

    def _park(self, progress: dict[str, int | None], checkpoint_root: Path) -> bool:
        """Stopped at a batch boundary: wait, holding the lease, until handed off (False) or resumed (True)."""
        patiently(lambda: lease.park(self.url, self.job, self.run_id, progress, self.lease_seconds), self.registry)
        log.info("job %s run %s parked at %s for up to %.0f s", self.job, self.run_id, progress, self.lease_seconds)
        while (decision := self._decide(checkpoint_root)) == "wait":
            time.sleep(0.5)
        log.info("job %s run %s: %s", self.job, self.run_id, decision)
        return decision == "resume"

    def _give_up(self, checkpoint_root: Path, exc: Exception, how: str) -> NoReturn:
        """End this run by itself, its reason beside its checkpoint (for the run's `job.end`): the registry refuses
        it, or has not answered for its whole patience."""
        answer = "refused it" if refused(exc) else "did not answer"
        reason = f"{how}: the registry {answer} ({str(getattr(exc, 'orig', None) or exc).strip().splitlines()[0]})"
        log.error("job %s run %s: %s", self.job, self.run_id, reason)
        checkpoints.write_gave_up(checkpoint_root, reason)
        raise GaveUp(reason) from exc

    def _decide(self, checkpoint_root: Path) -> lease.Decision:
        """The lease's decision; a registry that does not answer means wait, not fail: the run is parked on a
        clean boundary, and failing would leave it unresumable. It waits for the registry's patience at most, and not at
        all on a database that answered no for good (a refused password, a missing or read-only database): then the
        driver ends, freeing its cores (its master then reports it ended)."""
        try:
            decision = lease.decide(self.url, self.job, self.run_id)
        except TRANSIENT as exc:
            now = time.monotonic()
            self._unanswered_since = self._unanswered_since or now
            answered_no = refused(exc)
            if answered_no or now - self._unanswered_since > db.REGISTRY_PATIENCE_SECONDS:
                self._give_up(checkpoint_root, exc, f"parked, it gave up its lease and ended after "
                              f"{now - self._unanswered_since:.0f} s")
            log.warning("%s: the database did not answer (%s); still parked", self.registry, exc)
            return "wait"
        self._unanswered_since = None
        return decision


def stop_queries(spark: Any) -> None:
    """Stop what still runs of a failing run's queries (one stage's failure leaves the others running)."""
    try:
        for query in spark.streams.active:
            query.stop()
    except Exception as exc:  # noqa: BLE001 - a session already gone has nothing running
        log.warning("the queries did not stop cleanly (%s)", exc)


def warm_up(spark: Any, seconds: float) -> bool:
    """Before a standby says it is ready: wait for an executor, and run one stateful micro-batch of a throwaway
    query (a file of its own, a memory sink, a scratch checkpoint, Trigger.AvailableNow), so the first batch after
    the handoff finds the executor's JVM, its Python workers and Spark's streaming classes loaded. A failed warm-up
    costs time later, never the job. False when it did not end within `seconds` (no executor came): its jobs are
    cancelled, and a standby that cannot run a task cannot be ready."""
    finished = threading.Event()

    def run() -> None:
        try:
            _warm_up(spark)
        finally:
            finished.set()

    threading.Thread(target=run, name="changeover-warm-up", daemon=True).start()
    if finished.wait(max(seconds, 0.0)):
        return True
    spark.sparkContext.cancelAllJobs()
    return False


def _warm_up(spark: Any) -> None:
    import tempfile

    try:
        spark.sparkContext.parallelize([0], 1).map(lambda x: x).count()
        with tempfile.TemporaryDirectory(prefix="changeover-warm-up-") as scratch:
            source = Path(scratch) / "in"
            source.mkdir()
            (source / "0.json").write_text('{"key": "a"}\n{"key": "b"}\n')
            counts = spark.readStream.schema("key string").json(str(source)).groupBy("key").count()
            query = (counts.writeStream.format("memory").queryName(f"changeover_warm_up_{os.getpid()}")
                     .outputMode("complete").option("checkpointLocation", str(Path(scratch) / "checkpoint"))
                     .trigger(availableNow=True).start())
            if not query.awaitTermination(WARM_UP_SECONDS):
                query.stop()
    except Exception as exc:  # noqa: BLE001 - py4j surfaces JVM errors of any kind
        log.warning("the warm-up did not finish (%s); the first batch will be slower", exc)


def run_script(module: str) -> None:
    """An unchanged script: run as `python script.py` would, its `__main__` block included."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ImportError(f"job module {module} is not on the driver's path (shipped with --py-files)")
    runpy.run_path(spec.origin, run_name="__main__")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job", required=True)
    parser.add_argument("--run-id", type=int, required=True)
    parser.add_argument("--module", required=True)
    parser.add_argument("--entry", choices=ENTRIES, default="build")
    parser.add_argument("--expected-version", required=True)
    parser.add_argument("--checkpoint-root")
    parser.add_argument("--allow-non-restored-state", action="store_true")
    parser.add_argument("--standby", action="store_true", help="a warm successor: wait for the checkpoint")
    parser.add_argument("--lease-seconds", type=float)
    parser.add_argument("--stop-deadline", type=float, default=60.0)
    parser.add_argument("--self-fence-seconds", type=float)
    parser.add_argument("--state-partitions", type=int, help="repartition restored state to this many first")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("py4j").setLevel(logging.WARNING)
    from pyspark.sql import SparkSession

    parent = os.getppid()  # the driver JVM that runs this Python
    driver = Driver(Settings.from_env(), args.job, args.run_id, args.lease_seconds, args.stop_deadline,
                    args.self_fence_seconds)
    patiently(partial(driver.record_submission, Path.cwd()), driver.registry)
    spark = SparkSession.builder.appName(f"changeover-{args.job}").getOrCreate()
    # alive from the session's start: a parked predecessor then waits for this run to start
    if not patiently(driver.heartbeat, driver.registry):
        log.warning("job %s run %s ended before its driver started; nothing to run", args.job, args.run_id)
        spark.stop()
        return 0
    try:
        if spark.version != args.expected_version:
            message = version_mismatch(args.job, spark.version, args.expected_version)
            print(message, file=sys.stderr, flush=True)
            driver.fail(message)
            return 3
        options = patiently(driver.options, driver.registry)
        context = JobContext(args.job, args.run_id, options)
        if args.entry == "build":
            stages = importlib.import_module(args.module).build(spark, context)
            if args.standby:
                handed = driver.await_handoff(spark, stages)
                if handed is None:
                    return 0
                root, plans, started = handed.root, handed.plans, handed.queries
            else:
                root, plans, started = Path(args.checkpoint_root), None, None
                if args.state_partitions is not None:
                    driver.rescale(spark, root, args.state_partitions, [stage.name for stage in stages])
            if not driver.run_streaming(stages, root, args.allow_non_restored_state, spark, plans, started):
                return 4
            return 0
        driver.report({}, committed=False)
        if args.entry == "run":
            importlib.import_module(args.module).run(spark, context)
        else:
            run_script(args.module)
        driver.report({}, committed=False, state="FINISHED")
        return 0
    except GaveUp:
        return 5  # its reason is beside its checkpoint; recording a failure would leave the job down
    except Exception as exc:
        if jvm_lost(exc, parent):
            driver.lost_jvm(f"its driver's JVM ended under its Python ({type(exc).__name__}: {exc}): killed, or it "
                            "crashed; the checkpoint is whole as of the last commit")
            return 137
        driver.stand_down_queries()  # a write waiting for a hand-over gives up, so the queries can stop
        stop_queries(spark)  # before the failure is on record: a parked run may resume on it, and write the same sinks
        driver.fail(f"job {args.job}: {type(exc).__name__}: {exc}")
        raise
    finally:
        try:
            spark.stop()
        except Exception as exc:  # noqa: BLE001 - with its JVM gone, stopping the session fails too
            log.warning("job %s run %s: the Spark session did not stop cleanly (%s)", args.job, args.run_id, exc)
