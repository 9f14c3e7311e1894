"""A read-only follower: a standby that keeps a checkpoint of its own one batch behind its predecessor's.

Spark cannot feed a running query offsets from elsewhere, but a query started on a checkpoint whose newest offset
entry has no commit re-runs exactly that batch: the logged offsets, the logged watermark, the same files. So the
follower hands itself one batch of the predecessor at a time (its offset entry and the source log entries it points
at, never its commit), as soon as the predecessor has logged it, and runs the stage once with `Trigger.Once`: the
state stores reach that batch's version and nothing reaches the user's data. The replay commits only once the
predecessor has committed the batch (`Follower`). The first replay writes into its sink's shadow (`Sink.shadow`, a
scratch folder that is dropped), so the first real write later finds the writer warm; the rest into Spark's noop
sink, which costs least, so the follower keeps up. More than one batch at a time would skip the state of the ones
between.

At the cut-over the predecessor stops after a whole batch M, which it names once M has begun: the follower replays up
to M, takes the batch the predecessor had planned after M if it logged one (so it re-runs with those offsets, as the
predecessor would have), and its queries then start with the job's own sinks from its own checkpoint, before the
hand-over; their first write waits for it (`handoff.fence`).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from changeover.errors import ChangeoverError
from changeover.runtime import checkpoints
from changeover.runtime.contract import Stage
from changeover.runtime.sinks.base import run_without_writing

log = logging.getLogger(__name__)
SHADOW = ".shadow"  # where a sink's stand-in writes what it would write (a dot folder: not a stage)
LEADER_BATCH_SECONDS = 120.0  # how long an early replay waits for the leader's commit of its batch
COMMIT_POLL_SECONDS = 0.02
STOPPED_POLL_SECONDS = 0.5


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.read_bytes() == b.read_bytes()
    except FileNotFoundError:
        return False


def _same_query(leader: Path, own: Path) -> None:
    """A stage the savepoint had no commit of gets the predecessor's query id: the same query, continued."""
    if (leader / "metadata").exists() and not (own / "metadata").exists():
        own.mkdir(parents=True, exist_ok=True)
        shutil.copy(leader / "metadata", own / "metadata")


class CannotFollow(ChangeoverError):
    """The predecessor's checkpoint no longer holds a batch the follower needs (Spark purged its log entry)."""


def lag(leader_root: Path, root: Path, stages: list[str]) -> dict[str, int]:
    """Per stage, how many batches the leader's checkpoint has committed that the follower's has not."""
    def newest(checkpoint: Path) -> int:
        found = checkpoints.last_commit(checkpoint)
        return -1 if found is None else found
    return {stage: newest(leader_root / stage) - newest(root / stage) for stage in stages}


def replayed_since(root: Path, stages: list[str], since: float) -> dict[str, int]:
    """Per stage, how many batches the follower has committed itself since `since` (a POSIX time): the restored
    savepoint's commits are links to older files."""
    def written_since(commit: Path) -> bool:
        try:
            return commit.stat().st_mtime >= since
        except FileNotFoundError:  # purged by Spark's log retention meanwhile: an old batch
            return False

    def count(commits: Path) -> int:
        return sum(1 for p in commits.iterdir() if p.name.isdigit() and written_since(p)) if commits.is_dir() else 0
    return {stage: count(root / stage / "commits") for stage in stages}


class Withdrawn(Exception):
    """An early replay's batch that the leader stopped without committing: the follower must not commit it either."""


class Follower:
    """stopped: whether the leader has stopped (parked or ended): then a batch it has not committed never will be.

    A batch is replayed as soon as the leader has logged its offsets, beside the leader's own run of it, so that the
    follower is level with the leader when it stops rather than a replay behind. The replay's write waits, before
    Spark commits it in the follower's checkpoint, until the leader has committed the batch; one the leader stopped
    without committing fails there (`Withdrawn`), with nothing committed, so the follower never gets ahead."""

    def __init__(self, spark: Any, stages: list[Stage], root: Path, leader_root: Path,
                 stopped: Callable[[], bool]) -> None:
        self.spark, self.stages, self.root, self.leader_root = spark, stages, root, leader_root
        self.stopped = stopped
        self.replay_seconds: list[float] = []
        self.shadowed: set[str] = set()  # stages whose sink's shadow has written a batch

    def committed(self) -> dict[str, int | None]:
        return {stage.name: checkpoints.last_commit(self.root / stage.name) for stage in self.stages}

    def step(self, through: dict[str, int] | None = None) -> bool:
        """Replay the next batch of every stage that is behind: committed by the leader, or logged and being run by a
        leader that has not stopped; none past `through`. The stages' replays run at once, each in its own thread, as
        the leader's own queries do: one after the other, a job of two stages would take twice the leader's time a
        batch. True when any was replayed."""
        due: list[tuple[Stage, int]] = []
        for stage in self.stages:
            own = checkpoints.last_commit(self.root / stage.name)
            lead = checkpoints.last_commit(self.leader_root / stage.name)
            batch = 0 if own is None else own + 1
            if through is not None and batch > through.get(stage.name, batch):
                continue
            running = (self.leader_root / stage.name / "offsets" / str(batch)).exists() and not self.stopped()
            if (lead is not None and batch <= lead) or running:
                due.append((stage, batch))
        if len(due) <= 1:
            return any(self._replay(stage, batch) for stage, batch in due)
        with ThreadPoolExecutor(max_workers=len(due), thread_name_prefix="replay") as pool:
            replays = [pool.submit(self._replay, stage, batch) for stage, batch in due]
        return any([replay.result() for replay in replays])  # every one, so that a failure is raised

    def finish(self, replayed: Callable[[], None] = lambda: None) -> dict[str, int | None]:
        """At the cut-over, with the predecessor parked: replay up to its last commit (calling `replayed` after each
        round, for the driver's heartbeat), then take the batch it planned next, if any, for the job's own sinks to
        run. Returns the batch each stage is at."""
        while self.step():
            replayed()
        shutil.rmtree(self.root / SHADOW, ignore_errors=True)
        for stage in self.stages:
            own = checkpoints.last_commit(self.root / stage.name)
            _same_query(self.leader_root / stage.name, self.root / stage.name)
            checkpoints.snapshot_pending(self.leader_root / stage.name, self.root / stage.name,
                                         -1 if own is None else own, link=True)
        return self.committed()

    def _replay(self, stage: Stage, batch: int) -> bool:
        leader, own = self.leader_root / stage.name, self.root / stage.name
        if not (leader / "offsets" / str(batch)).exists():
            raise CannotFollow(f"following stage {stage.name} at batch {batch}",
                               f"the predecessor's checkpoint {leader} no longer holds that batch's offsets (Spark "
                               "keeps the newest spark.sql.streaming.minBatchesToRetain)",
                               "move the job with the warm strategy, or start the follower from a newer savepoint")
        _same_query(leader, own)
        checkpoints.snapshot_pending(leader, own, batch - 1, link=True)
        if not _same_file(own / "offsets" / str(batch), leader / "offsets" / str(batch)):
            # purged meanwhile, or another entry: Spark would plan a batch of its own, and the state would diverge
            raise CannotFollow(f"following stage {stage.name} at batch {batch}", "its offset entry in the follower's "
                               "checkpoint is not the predecessor's", "move the job with the warm strategy")
        began = time.monotonic()
        shadowed, scratch = stage.name in self.shadowed, self.root / SHADOW / stage.name

        def write(frame: Any, _batch: int) -> None:
            # its writer warm, the rest compute their batch only (Spark's noop sink), to keep up
            run_without_writing(frame) if shadowed else stage.sink.shadow(frame, scratch)
            self._await_leader(leader, batch)

        query = (stage.frame.writeStream.foreachBatch(write).outputMode(stage.output_mode)
                 .queryName(f"{stage.name}_follower").option("checkpointLocation", str(own))
                 .trigger(once=True).start())
        with contextlib.suppress(Exception):  # it raises the query's failure, wrapped by py4j: read below instead
            query.awaitTermination()
        failure = query.exception()
        if failure is not None:
            if Withdrawn.__name__ in str(failure):
                log.info("follower: stage %s batch %d withdrawn: the leader stopped before committing it",
                         stage.name, batch)
                return False
            raise failure
        if checkpoints.last_commit(own) != batch:
            raise ChangeoverError(f"replay of batch {batch} of stage {stage.name}", f"its checkpoint {own} committed "
                                  f"{checkpoints.last_commit(own)} instead", "end the follower; the job moves warm")
        self.shadowed.add(stage.name)
        self.replay_seconds.append(time.monotonic() - began)
        log.info("follower: stage %s replayed batch %d read-only in %.2f s", stage.name, batch,
                 self.replay_seconds[-1])
        return True

    def _await_leader(self, leader: Path, batch: int) -> None:
        """Inside the replay's write, before Spark commits it: until the leader has committed the batch. A leader
        that stopped without it (looked at before its checkpoint: a stop comes after any commit), or that has not
        committed it within LEADER_BATCH_SECONDS, withdraws it."""
        deadline, asked = time.monotonic() + LEADER_BATCH_SECONDS, 0.0
        while not (leader / "commits" / str(batch)).exists():
            if time.monotonic() - asked >= STOPPED_POLL_SECONDS:
                asked = time.monotonic()
                if self.stopped() and not (leader / "commits" / str(batch)).exists():
                    raise Withdrawn(f"batch {batch}: its leader stopped without committing it")
            if time.monotonic() >= deadline:
                raise Withdrawn(f"batch {batch}: its leader did not commit it within {LEADER_BATCH_SECONDS:.0f} s")
            time.sleep(COMMIT_POLL_SECONDS)
