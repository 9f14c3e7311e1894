"""A job's stages as long-lived streaming queries, one per stage for the life of the run.

A stop waits until no trigger is active, or the running batch commits, or the trigger is only planning the next
batch (listing files, no offsets written yet), then stops the query, so the last commit is a whole batch. A query
whose batches follow each other back to back is stopped just after a commit: the next batch may have begun, which
leaves at most an offset entry ahead of the last commit. Spark replays it with
the same offsets, savepoints keep that entry, and the sinks recognise a replayed batch. Past the deadline (one
batch that runs longer) the stop is given up and the queries run on. A move's stop between batches first waits for
each query's next batch, and stops after its commit, so the downtime starts at the stop, not a commit past.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from changeover.runtime.checkpoints import last_commit, last_offsets
from changeover.runtime.contract import Stage, interval_seconds
from changeover.runtime.sinks import WriteContext

if TYPE_CHECKING:
    from changeover.runtime.follower import InQueryReplay

POLL_SECONDS = 0.02
log = logging.getLogger(__name__)


def _later(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


class StageQueries:
    def __init__(self, stages: list[Stage], checkpoint_root: Path, registry_url: str, job: str, run_id: int,
                 replay: InQueryReplay | None = None) -> None:
        self.stages, self.root = stages, checkpoint_root
        self.registry_url, self.job, self.run_id = registry_url, job, run_id
        self.replay = replay  # a primed follower's catch-up in these queries (`WriteContext.replay`)
        self.queries: dict[str, Any] = {}
        self.stand_down = threading.Event()  # set: every write of the running queries waiting for the registry gives up
        self.started_from: dict[str, int | None] = {}  # each stage's last commit when all its queries started

    def start(self, only: list[str] | None = None) -> None:
        if self.stand_down.is_set():  # a new one: a write of the stopped queries that still waits keeps giving up
            self.stand_down = threading.Event()
        if only is None:
            self.started_from = self.position()
            if self.replay is not None:
                self.replay.restart(self.committed())
        for stage in self.stages:
            if only is not None and stage.name not in only:
                continue
            context = WriteContext(self.registry_url, self.job, stage.name, self.run_id, str(self.root / stage.name),
                                   self.stand_down, self.replay)
            self.queries[stage.name] = (
                stage.sink.attach(stage.frame, context).queryName(stage.name)
                .outputMode(stage.output_mode)
                .option("checkpointLocation", str(self.root / stage.name))
                .trigger(processingTime=stage.trigger)
                .start()
            )

    def committed(self) -> dict[str, int | None]:
        return {stage.name: last_commit(self.root / stage.name) for stage in self.stages}

    def position(self) -> dict[str, int | None]:
        """Each stage's last commit that is not its own to report: its checkpoint's, or the predecessor's last batch,
        which it replays without writing (`replay.through`), whichever is later."""
        replayed = self.replay.through if self.replay is not None else {}
        return {name: _later(last, replayed.get(name)) for name, last in self.committed().items()}

    def have_run(self) -> bool:
        """Every query has finished a trigger of its own, data or none: one past the batch it started from (a
        primed follower's queries first replay their predecessor's last batch, `Standby._prime_in_queries`)."""
        def past_start(name: str, query: Any) -> bool:
            progress, start = query.lastProgress, self.started_from.get(name)
            return progress is not None and (start is None or int(progress["batchId"]) > start)
        return bool(self.queries) and all(past_start(name, q) for name, q in self.queries.items())

    def failure(self) -> Exception | None:
        for query in self.queries.values():
            if not query.isActive:
                return query.exception() or RuntimeError(f"query {query.name} ended by itself")
        return None

    def stand_down_now(self) -> list[str]:
        """Stop every query now, a batch waiting for the registry inside its write included: that write gives up
        (`WriteContext.patiently`), so its batch fails with nothing logged, and is replayed when the queries start
        again; so does a primed follower's replay waiting on its predecessor. Returns the stages stopped."""
        self.stand_down.set()
        if self.replay is not None:  # and a replay waiting on the predecessor
            self.replay.cancelled.set()
        return self.stop_now()

    def stop_now(self, only: list[str] | None = None) -> list[str]:
        """Stop the running queries (of the stages named), wherever their batches are; returns the stages stopped."""
        stopped = [name for name in self.queries if only is None or name in only]
        for name in stopped:
            self.queries.pop(name).stop()
        return stopped

    def at_boundary(self, name: str, before: int | None) -> bool:
        """Whether stopping this query now cuts no batch: no trigger active; or the batch that was running has
        committed; or the trigger is only planning (listing files, no offsets written beyond the last commit)."""
        query = self.queries[name]
        if not query.isActive or not query.status["isTriggerActive"]:
            return True
        committed = last_commit(self.root / name)
        return committed != before or last_offsets(self.root / name) == committed

    def stop_at_boundary(self, deadline_seconds: float, after_commit: bool = False,
                         on_last: Callable[[dict[str, int]], None] | None = None, fresh: bool = False) -> bool:
        """Stop every query at its next boundary, all watched at once. False, with every query running again,
        past the deadline. after_commit (a move, asked between batches): first wait for every query's next batch to
        begin, all at once, up to two trigger intervals and half the deadline, so each stops right after that batch's
        commit. A move's downtime runs from the last commit: a stop between batches would start it up to an interval
        before the stop. The deadline runs from the end of that wait, as for a stop asked while those batches run.
        Not waited for: a query whose last three triggers read no input (none may come). on_last (after_commit): told
        the batch each query stops after, once every one of those batches has begun, or {} if one has not (its
        follower then replays the running batches beside it, as before a move). fresh (a follower follows the
        job): a query asked while a batch runs waits for the next one instead (unless its batches run back to back),
        which the follower, one batch short of it by then, runs in the job's own queries
        (`runtime.follower.InQueryReplay`); if that one has not begun within the wait, it stops after the running one.
        """
        before = {name: last_commit(self.root / name) for name in self.queries}
        if after_commit:
            self._await_next_batches({name: self._stop_after(name, before[name], fresh) for name in self.queries},
                                     deadline_seconds / 2)
            before = {name: last_commit(self.root / name) for name in self.queries}  # those begun since are the last
            last = {name: 0 if committed is None else committed + 1 for name, committed in before.items()}
            if on_last is not None:  # each begun, none past; else none named
                on_last(last if all(last_offsets(self.root / name) == batch for name, batch in last.items()) else {})
        deadline = time.monotonic() + deadline_seconds
        stopped: list[str] = []
        while self.queries:
            for name in [n for n in self.queries if self.at_boundary(n, before[n])]:
                self.queries.pop(name).stop()
                stopped.append(name)
            if not self.queries:
                return True
            if time.monotonic() >= deadline:
                self.start(only=stopped)
                return False
            time.sleep(POLL_SECONDS)
        return True

    def _stop_after(self, name: str, committed: int | None, fresh: bool) -> int | None:
        """The batch past which a move's stop waits for the next to begin: the last commit, or with a follower
        (`fresh`) the running batch, unless batches run back to back (the next would be planned before a stop)."""
        running = last_offsets(self.root / name)
        if fresh and running is not None and running != committed and not self._back_to_back(name):
            return running
        return committed

    def _interval(self, name: str) -> float | None:
        return interval_seconds(next(stage.trigger for stage in self.stages if stage.name == name))

    def _back_to_back(self, name: str) -> bool:
        """Whether the query's last batches each took its whole trigger interval or more: the next one is planned
        the moment one commits, before a stop could come between them."""
        interval = self._interval(name)
        recent = self.queries[name].recentProgress[-3:]
        return interval is None or bool(recent) and all(
            progress.get("durationMs", {}).get("triggerExecution", 0) >= 1000 * interval for progress in recent)

    def _awaits_input(self, name: str) -> bool:
        """Whether a next batch is to be waited for: the query's recent triggers read input, and its trigger is an
        interval."""
        recent = self.queries[name].recentProgress[-3:]
        if recent and all(progress.get("numInputRows", 1) == 0 for progress in recent):
            # its last triggers found no input (Spark reports such a trigger at most every 10 s; a watermark's
            # no-data batch, right after a batch that read input, is one of them)
            return False
        if self._interval(name) is None:
            log.warning("stage %s: its trigger is not a form read here; its stop does not wait for a batch", name)
            return False
        return True

    def _await_next_batches(self, past: dict[str, int | None], at_most: float) -> None:
        """Until every query that awaits input plans a batch past `past` (its offsets), or ends, up to two of the
        longest of their trigger intervals."""
        waiting = [name for name in past if self._awaits_input(name)]
        if not waiting:
            return
        until = time.monotonic() + min(2 * max(self._interval(name) or 0.0 for name in waiting), at_most)
        while time.monotonic() < until and any(
                self.queries[name].isActive and last_offsets(self.root / name) == past[name] for name in waiting):
            time.sleep(POLL_SECONDS)
