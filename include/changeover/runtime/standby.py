"""A warm standby inside the Spark driver: its warm-up, its wait for the checkpoint, following its predecessor
read-only, and priming the job's queries before the hand-over.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from changeover import faults
from changeover.handoff import lease
from changeover.registry.db import TRANSIENT, patiently, session_scope
from changeover.registry.models import JobRun
from changeover.runtime import checkpoints
from changeover.runtime.contract import Stage, unmatched_state
from changeover.runtime.follower import CannotFollow, Follower, InQueryReplay, PlannedPast, Withdrawn
from changeover.runtime.queries import StageQueries
from changeover.runtime.reports import RunReports

log = logging.getLogger("changeover.driver")

STANDBY_POLL_SECONDS = 0.05  # how often a ready standby looks for its checkpoint: the move's downtime waits on it
PRIME_POLL_SECONDS = 0.02  # how often a priming follower looks for its predecessor's park: the downtime waits on it
PRIME_CHECK_SECONDS = 0.5  # and how often it heartbeats and looks whether the cut-over still comes
STANDBY_WAIT_SECONDS = 1800.0  # a standby never handed its job leaves by itself
WARM_UP_SECONDS = 120.0


class Superseded(Exception):
    """A follower's cut-over ended before it wrote anything: the parked run took its job back, or the move was
    withdrawn."""


@dataclass(frozen=True)
class Handed:
    """What a standby was handed: the checkpoint it runs from, its stages' plans, and its queries when a follower
    started them before the hand-over (`Standby._prime`)."""

    root: Path
    plans: dict[str, Any] | None
    queries: StageQueries | None = None


class Standby(RunReports):
    """A warm standby's half of the driver: warmed up and ready, it waits for its checkpoint, following its
    predecessor read-only when given one, and primes the job's queries at the cut-over (`await_hand_over`)."""

    def await_hand_over(self, spark: Any, stages: list[Stage]) -> Handed | None:
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
        if turn == "dismissed" and self._dismissed(primed, follower):
            return None
        if primed is None and follower is None and (roots := patiently(partial(lease.followed, self.url,
                                                                               self.run_id), self.registry)):
            follower = Follower(spark, stages, *roots, self._leader_stopped)  # handed the job before it looked
        if primed is None and follower is not None and not self._catch_up_handed(follower):
            return None
        with session_scope(self.url) as s:
            run = s.get(JobRun, self.run_id)
            assert run is not None and run.checkpoint_root
            return Handed(Path(run.checkpoint_root), plans, primed)

    def _dismissed(self, primed: StageQueries | None, follower: Follower | None) -> bool:
        """A standby dismissed while it waited: ended, its queries primed before the hand-over stood down, and its
        checkpoint removed. False when it was handed the job just before, and goes on."""
        ended = patiently(partial(lease.end_standby, self.url, self.job, self.run_id, "dismissed: the run it was "
                                  "to succeed is no longer the job's, or its move was withdrawn"), self.registry)
        look = partial(lease.standby_turn, self.url, self.job, self.run_id)
        if ended or patiently(look, self.registry) != "start":  # not ended: handed the job just before
            if primed is not None and follower is not None:
                primed.stand_down_now()
                shutil.rmtree(follower.root, ignore_errors=True)  # may hold a batch it planned alone
            return True
        return False

    def _catch_up_handed(self, follower: Follower) -> bool:
        """A follower handed the job before it primed: it replays the rest of its predecessor's batches, and says where
        it is before anything could write. False when the parked run took its job back meanwhile: it has ended."""
        began = time.monotonic()
        try:
            at = follower.finish(self._still_handed)
        except Superseded:
            why = "the parked run took its job back while it caught up: it ends, having written nothing"
            log.warning("job %s run %s: %s", self.job, self.run_id, why)
            self._end_follower(follower, why)
            return False
        patiently(partial(lease.report_following, self.url, self.run_id, at), self.registry)  # see `fence`
        log.info("job %s run %s: handed the job, caught up to %s in %.2f s", self.job, self.run_id, at,
                 time.monotonic() - began)
        self._record_level(at, "after_hand_over", began)
        faults.reached_in_job("follower.caught_up")  # mid cut-over: current, nothing written yet
        return True

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


def warm_up(spark: Any, seconds: float) -> bool:
    """Before a standby says it is ready: wait for an executor, and run one stateful micro-batch of a throwaway
    query (a file of its own, a memory sink, a scratch checkpoint, Trigger.AvailableNow), so the first batch after
    the hand-over finds the executor's JVM, its Python workers and Spark's streaming classes loaded. A failed warm-up
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
