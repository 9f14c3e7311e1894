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

At the cut-over the predecessor stops after a whole batch M, which it names once M has begun. A follower one batch
short of M starts the job's own queries there, with the job's sinks, on its own checkpoint holding M's offsets: they
run M beside the predecessor without writing it (`InQueryReplay`), and once the predecessor has committed M and
parked they plan M+1 themselves, their state loaded and their plans built, so the job's next batch costs no new query.
Its write waits for the hand-over (`handoff.fence`). A follower that is not there (it replayed M already, or the
predecessor logged a batch past M before its stop) replays up to M, takes the batch the predecessor had planned after M
if it logged one (so it re-runs with those offsets, as the predecessor would have), and starts the queries then.
While the predecessor is asked to move, a following follower replays only batches it has committed: the one it runs
may be its last, which the queries above would run instead.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
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
        try:
            return sum(1 for p in commits.iterdir() if p.name.isdigit() and written_since(p))
        except FileNotFoundError:  # none yet, or removed by a follower that ended itself
            return 0
    return {stage: count(root / stage / "commits") for stage in stages}


class Withdrawn(Exception):
    """An early replay's batch that the leader stopped without committing: the follower must not commit it either."""


class PlannedPast(Exception):
    """At the cut-over the leader logged a batch past the one it stops after (its stop came as it planned it): the
    follower's queries would plan that batch with offsets of their own, so they stop before, and the follower takes
    the leader's (`Follower.finish`)."""


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

    def step(self, through: dict[str, int] | None = None, running_too: Callable[[], bool] = lambda: True) -> bool:
        """Replay the next batch of every stage that is behind: committed by the leader, or logged and being run by a
        leader that has not stopped (unless `running_too` says no); none past `through`. The stages' replays run at
        once, each in its own thread, as the leader's own queries do: one after the other, a job of two stages would
        take twice the leader's time a batch. True when any was replayed."""
        due: list[tuple[Stage, int]] = []
        for stage in self.stages:
            own = checkpoints.last_commit(self.root / stage.name)
            lead = checkpoints.last_commit(self.leader_root / stage.name)
            batch = 0 if own is None else own + 1
            if through is not None and batch > through.get(stage.name, batch):
                continue
            if (lead is not None and batch <= lead) or (
                    (self.leader_root / stage.name / "offsets" / str(batch)).exists() and not self.stopped()
                    and running_too()):
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

    def level_short_of(self, through: dict[str, int]) -> bool:
        """Whether the job's queries can start here (`InQueryReplay`): every stage has committed the batch before
        the one named, and the leader has logged that one."""
        if set(through) != {stage.name for stage in self.stages}:
            return False
        return all(checkpoints.last_commit(self.root / name) == batch - 1
                   and (self.leader_root / name / "offsets" / str(batch)).exists() for name, batch in through.items())

    def take_batch(self, stage: str, batch: int) -> None:
        """The leader's offset entry of `batch` (and the source log entries it points at) in the follower's
        checkpoint, uncommitted, so that a query started on it runs exactly that batch."""
        leader, own = self.leader_root / stage, self.root / stage
        if not (leader / "offsets" / str(batch)).exists():
            raise CannotFollow(f"following stage {stage} at batch {batch}",
                               f"the predecessor's checkpoint {leader} no longer holds that batch's offsets (Spark "
                               "keeps the newest spark.sql.streaming.minBatchesToRetain)",
                               "move the job with the warm strategy, or start the follower from a newer savepoint")
        _same_query(leader, own)
        checkpoints.snapshot_pending(leader, own, batch - 1, link=True)
        if not _same_file(own / "offsets" / str(batch), leader / "offsets" / str(batch)):
            # purged meanwhile, or another entry: Spark would plan a batch of its own, and the state would diverge
            raise CannotFollow(f"following stage {stage} at batch {batch}", "its offset entry in the follower's "
                               "checkpoint is not the predecessor's", "move the job with the warm strategy")

    def _replay(self, stage: Stage, batch: int) -> bool:
        leader, own = self.leader_root / stage.name, self.root / stage.name
        self.take_batch(stage.name, batch)
        began = time.monotonic()
        shadowed, scratch = stage.name in self.shadowed, self.root / SHADOW / stage.name

        def write(frame: Any, _batch: int) -> None:
            # its writer warm, the rest compute their batch only (Spark's noop sink), to keep up
            run_without_writing(frame) if shadowed else stage.sink.shadow(frame, scratch)
            self.await_leader(leader, batch)

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

    def await_leader(self, leader: Path, batch: int, looks: Callable[[], None] = lambda: None) -> None:
        """Inside a replay's write, before Spark commits it: until the leader has committed the batch. A leader
        that stopped without it (looked at before its checkpoint: a stop comes after any commit), or that has not
        committed it within LEADER_BATCH_SECONDS, withdraws it. `looks` is called between looks at the leader."""
        committed = leader / "commits" / str(batch)

        def look() -> None:
            looks()
            if self.stopped() and not committed.exists():
                raise Withdrawn(f"batch {batch}: its leader stopped without committing it")
        wait_on_leader(committed.exists, look, f"batch {batch}: its leader did not commit it within "
                       f"{LEADER_BATCH_SECONDS:.0f} s")

    def await_stopped(self, looks: Callable[[], None]) -> None:
        """Until the leader has stopped (parked, or ended), calling `looks` between looks."""
        wait_on_leader(self.stopped, looks, f"its leader did not stop within {LEADER_BATCH_SECONDS:.0f} s of its "
                       "last batch")


def wait_on_leader(ready: Callable[[], bool], look: Callable[[], None], withdrawn: str) -> None:
    """A replay's wait inside its write: until `ready`, calling `look` (which raises to end it) between looks at the
    leader; past LEADER_BATCH_SECONDS the batch is withdrawn."""
    deadline, looked = time.monotonic() + LEADER_BATCH_SECONDS, 0.0
    while not ready():
        if time.monotonic() - looked >= STOPPED_POLL_SECONDS:
            look()
            looked = time.monotonic()
        if time.monotonic() >= deadline:
            raise Withdrawn(withdrawn)
        time.sleep(COMMIT_POLL_SECONDS)


class InQueryReplay:
    """The write hook of the job's own queries, started one batch short of `through`, the leader's last per stage
    (`WriteContext.replay`, `Standby._prime_in_queries`). A batch up to `through` is the leader's: it runs without
    writing, beside the leader's own run of it, and is let through to Spark's commit once the leader has committed
    it. At `through` it also waits until the leader has stopped, so that the queries plan nothing past it before the
    leader is known to have stopped there; refuses (`PlannedPast`) when the leader logged a batch past it; then waits
    until every stage is level, so that no stage commits its last batch while another may still refuse (all the
    stages then prime as before, from a clean checkpoint), and reports the follower level (`report_level`, once),
    before any write of the queries' own can reach the fence. Later batches are the sinks'. `check_cut_over` raises
    when the cut-over has ended; `cancelled`, set before its queries are stopped, ends a wait at once. What was raised
    first is kept in `raised`, whatever Spark makes of it; every other stage's wait then ends too."""

    def __init__(self, follower: Follower, through: dict[str, int], report_level: Callable[[], None],
                 check_cut_over: Callable[[], None]) -> None:
        self.follower, self.through = follower, through
        self.report_level, self.check_cut_over = report_level, check_cut_over
        self.levelled, self.cancelled = threading.Event(), threading.Event()
        self.raised: BaseException | None = None
        self._level: set[str] = set()  # stages that reached `through` and passed its checks
        self._lock = threading.Lock()

    def __call__(self, stage: str, batch: Any, batch_id: int) -> bool:
        if batch_id > self.through[stage]:
            return False
        try:
            run_without_writing(batch)  # its state stores reach the batch; nothing is committed until this returns
            leader = self.follower.leader_root / stage
            self.follower.await_leader(leader, batch_id, self._between_looks)
            if batch_id == self.through[stage]:
                self.follower.await_stopped(self._between_looks)
                if (leader / "offsets" / str(batch_id + 1)).exists():
                    raise PlannedPast(f"stage {stage}: the leader logged batch {batch_id + 1} before it stopped")
                self._level_at_last(stage)
        except BaseException as exc:
            with self._lock:
                if self.raised is None:
                    self.raised = exc
            raise
        return True

    def restart(self, committed: dict[str, int | None]) -> None:
        """For queries started again on the follower's checkpoint (after a failure, or handed the job as its cut-over
        ended), given each stage's last commit there: nothing raised or cancelled, and a stage that committed its last
        batch is level (it will not replay it again)."""
        with self._lock:
            self.raised = None
            self.cancelled.clear()
            self._level = {name for name, batch in self.through.items()
                           if (done := committed.get(name)) is not None and done >= batch}
            if self._level == set(self.through):
                self.levelled.set()
            else:
                self.levelled.clear()

    def _level_at_last(self, stage: str) -> None:
        """Level once every stage is: decided under the lock, so that a stage that has given up is never counted."""
        with self._lock:
            self._going_on()
            self._level.add(stage)
            decided = self._level == set(self.through)
        if decided:
            try:
                self.report_level()
            except BaseException:
                with self._lock:  # not level after all: the stages waiting withdraw, and none commits
                    self._level.discard(stage)
                raise
            self.levelled.set()
            return
        try:
            wait_on_leader(self.levelled.is_set, self._between_looks, "the other stages did not reach their "
                           "predecessor's last batch in time")
        except BaseException:
            with self._lock:
                if self._level == set(self.through):  # decided as it gave up: it commits with the others
                    return
                self._level.discard(stage)
            raise

    def _going_on(self) -> None:
        if self.cancelled.is_set():
            raise Withdrawn("the cut-over ended: its queries are stopping")
        if self.raised is not None:
            raise Withdrawn(f"another stage's replay refused its predecessor's last batch ({self.raised})")

    def _between_looks(self) -> None:
        self._going_on()
        self.check_cut_over()
