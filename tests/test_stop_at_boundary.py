"""Stopping long-lived queries at a batch boundary, on a real local Spark session.

Each batch's work waits for a gate file that the test creates, so a stop is requested while a batch is
certainly running, and the test decides when that batch may finish.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from changeover.cluster import wait_for
from changeover.runtime import Stage
from changeover.runtime.checkpoints import last_commit, last_offsets
from changeover.runtime.contract import interval_seconds
from changeover.runtime.queries import StageQueries
from changeover.runtime.sinks import Sink, WriteContext

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    from pyspark.sql import SparkSession

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    session = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
               .config("spark.sql.shuffle.partitions", "2").getOrCreate())
    yield session
    session.stop()


class _Noop(Sink):
    """Spark's own `noop` streaming sink: the stops are the subject here, and every declared sink writes through the
    registry's fence, which these tests have no job for."""

    kind, guarantee = "noop", "idempotent"

    def attach(self, frame: Any, context: WriteContext) -> Any:
        return frame.writeStream.format("noop")

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind}

    @classmethod
    def from_description(cls, description: dict[str, Any]) -> Sink:
        return cls()

    def progress(self, context: WriteContext) -> int | None:
        return None

    def rewind(self, context: WriteContext, batch: int | None, saved: Path | None) -> str:
        return "nothing to rewind"

    def redirected(self, suffix: str) -> Sink:
        return self


def _slow_stage(spark: Any, tmp_path: Path, files: int, trigger: str = "0 seconds") -> tuple[Stage, Path]:
    from pyspark.sql import functions as F

    source = tmp_path / "in"
    source.mkdir()
    for i in range(files):
        (source / f"{i}.txt").write_text("\n".join(str(n) for n in range(4)) + "\n")
    gate = str(tmp_path / "gate")

    @F.udf("long")
    def slow(value: str) -> int:
        while not os.path.exists(gate):  # held until the test opens the gate
            time.sleep(0.05)
        return int(value)

    frame = spark.readStream.option("maxFilesPerTrigger", 1).text(str(source)).select(slow("value").alias("n"))
    return Stage("slow", frame, _Noop(), trigger=trigger), tmp_path / "cp"


def _held_in_batch_0(spark: Any, tmp_path: Path, files: int, trigger: str = "0 seconds") -> tuple[StageQueries, Path]:
    """The slow stage started, its batch 0 planned and running, held at the gate."""
    stage, root = _slow_stage(spark, tmp_path, files=files, trigger=trigger)
    queries = StageQueries([stage], root, "sqlite://", "job", 1)
    queries.start()
    query = queries.queries["slow"]
    wait_for(lambda: query.status["isTriggerActive"] and last_offsets(root / "slow") == 0, 120,
             "batch 0 planned and running, held at the gate")
    return queries, root


def test_a_stop_waits_for_the_running_batch_to_commit(spark: Any, tmp_path: Path) -> None:
    queries, root = _held_in_batch_0(spark, tmp_path, files=6)
    query = queries.queries["slow"]
    stopped: list[bool] = []
    stopper = threading.Thread(target=lambda: stopped.append(queries.stop_at_boundary(120)))
    stopper.start()
    (tmp_path / "gate").touch()
    stopper.join(timeout=180)
    assert stopped == [True] and not query.isActive
    assert last_commit(root / "slow") == 0  # the running batch was finished, and the stop came right after it


def test_a_query_with_nothing_planned_stops_at_once(spark: Any, tmp_path: Path) -> None:
    stage, root = _slow_stage(spark, tmp_path, files=0)  # no input: every trigger only lists the folder
    queries = StageQueries([stage], root, "sqlite://", "job", 1)
    queries.start()
    wait_for(lambda: queries.queries["slow"].lastProgress is not None, 120, "a first trigger")
    assert queries.stop_at_boundary(0.5)  # nothing planned to cut: no waiting for a commit that never comes
    assert last_offsets(root / "slow") is None


def test_past_the_deadline_the_stop_is_given_up_and_the_queries_run_on(spark: Any, tmp_path: Path) -> None:
    stage, root = _slow_stage(spark, tmp_path, files=6)
    queries = StageQueries([stage], root, "sqlite://", "job", 1)
    queries.start()
    wait_for(lambda: queries.queries["slow"].status["isTriggerActive"] and last_offsets(root / "slow") == 0, 120,
             "batch 0 planned and running, held at the gate")
    assert not queries.stop_at_boundary(0.5)
    assert queries.queries["slow"].isActive and last_commit(root / "slow") is None  # it runs on, uncut
    (tmp_path / "gate").touch()
    wait_for(lambda: (last_commit(root / "slow") or -1) >= 5, 180, "every file's batch committed after all")
    queries.stop_now()


def test_a_moves_stop_between_batches_waits_for_the_next_batch_and_stops_right_after_its_commit(
        spark: Any, tmp_path: Path) -> None:
    """A move's downtime runs from the last commit: stopped between batches at once, it would begin at a commit
    already up to an interval old. The test decides when the next batch has input: after the stop has begun."""
    stage, root = _slow_stage(spark, tmp_path, files=1, trigger="3 seconds")
    (tmp_path / "gate").touch()
    queries = StageQueries([stage], root, "sqlite://", "job", 1)
    queries.start()
    query = queries.queries["slow"]
    wait_for(lambda: last_commit(root / "slow") == 0 and not query.status["isTriggerActive"], 120,
             "batch 0 committed and the query idle until its next trigger")
    stopped: list[bool] = []
    named: list[dict[str, int]] = []  # the batch it stops after, said once that batch has begun, before its commit
    stopper = threading.Thread(target=lambda: stopped.append(queries.stop_at_boundary(
        60, after_commit=True, on_last=lambda last: named.append({**last, "committed": last_commit(root / "slow")}))))
    stopper.start()
    arriving = tmp_path / "1.txt"  # written whole, then moved in: the source never lists half a file
    arriving.write_text("4\n5\n")
    arriving.rename(tmp_path / "in" / "1.txt")
    stopper.join(timeout=120)
    assert stopped == [True] and not query.isActive
    assert last_commit(root / "slow") == 1  # the batch of the file that came during the wait, whole
    assert last_offsets(root / "slow") == 1  # and the stop came right after its commit: nothing planned past it
    assert named == [{"slow": 1, "committed": 0}]


def test_a_moves_stop_of_two_stages_waits_for_both_next_batches_at_once_and_names_both(
        spark: Any, tmp_path: Path) -> None:
    """Two queries of the same input, as the demo's `clicks`: the stop waits for each one's next batch, all at once,
    and names the batch each stops after only once both have begun, so their follower can run both in their queries."""
    stage, root = _slow_stage(spark, tmp_path, files=1, trigger="3 seconds")
    (tmp_path / "gate").touch()
    queries = StageQueries([stage, Stage("slow_too", stage.frame, _Noop(), trigger="3 seconds")], root, "sqlite://",
                           "job", 1)
    queries.start()
    wait_for(lambda: all(last_commit(root / name) == 0 and not query.status["isTriggerActive"]
                         for name, query in queries.queries.items()), 120, "batch 0 of both committed, both idle")
    (tmp_path / "gate").unlink()  # batch 1 of each is held until both are named
    stopped: list[bool] = []
    named: list[dict[str, Any]] = []

    def on_last(last: dict[str, int]) -> None:
        named.append({**last, "committed": [last_commit(root / name) for name in ("slow", "slow_too")]})
        (tmp_path / "gate").touch()

    stopper = threading.Thread(target=lambda: stopped.append(queries.stop_at_boundary(
        60, after_commit=True, on_last=on_last)))
    stopper.start()
    arriving = tmp_path / "1.txt"
    arriving.write_text("4\n5\n")
    arriving.rename(tmp_path / "in" / "1.txt")
    stopper.join(timeout=120)
    assert stopped == [True] and not queries.queries
    assert named == [{"slow": 1, "slow_too": 1, "committed": [0, 0]}]  # named while both ran batch 1
    assert [(last_commit(root / name), last_offsets(root / name)) for name in ("slow", "slow_too")] == [(1, 1), (1, 1)]


def test_a_followed_moves_stop_asked_during_a_batch_stops_after_the_next_one(spark: Any, tmp_path: Path) -> None:
    """With a follower, the job's last batch is one begun after the stop was asked: from the ask on, the follower
    replays only committed batches, so it is one batch short of the last, which it runs in the job's own queries.
    Without one, the running batch is the last (the case above)."""
    queries, root = _held_in_batch_0(spark, tmp_path, files=2, trigger="2 seconds")
    query = queries.queries["slow"]
    stopped: list[bool] = []
    named: list[dict[str, int]] = []
    stopper = threading.Thread(target=lambda: stopped.append(queries.stop_at_boundary(
        60, after_commit=True, on_last=named.append, fresh=True)))
    stopper.start()
    (tmp_path / "gate").touch()
    stopper.join(timeout=120)
    assert stopped == [True] and not query.isActive and named == [{"slow": 1}]
    assert last_commit(root / "slow") == 1 and last_offsets(root / "slow") == 1


def test_a_followed_moves_stop_whose_next_batch_does_not_begin_in_time_stops_after_the_running_one(
        spark: Any, tmp_path: Path) -> None:
    """The running batch outlasts the wait for the next (two intervals): the stop names it and comes after its
    commit, cutting nothing."""
    queries, root = _held_in_batch_0(spark, tmp_path, files=2, trigger="2 seconds")
    stopped: list[bool] = []
    named: list[dict[str, int]] = []
    stopper = threading.Thread(target=lambda: stopped.append(queries.stop_at_boundary(
        60, after_commit=True, on_last=named.append, fresh=True)))
    stopper.start()
    wait_for(lambda: bool(named), 60, "the stop naming its last batch once its wait for the next one ended")
    (tmp_path / "gate").touch()
    stopper.join(timeout=120)
    assert stopped == [True] and named == [{"slow": 0}]
    assert last_commit(root / "slow") == 0 and last_offsets(root / "slow") == 0  # batch 0 whole, nothing after it


def test_a_moves_stop_of_a_query_that_read_no_input_does_not_wait(spark: Any, tmp_path: Path) -> None:
    stage, root = _slow_stage(spark, tmp_path, files=0, trigger="10 seconds")
    queries = StageQueries([stage], root, "sqlite://", "job", 1)
    queries.start()
    wait_for(lambda: queries.queries["slow"].lastProgress is not None, 120, "a first trigger")
    began = time.monotonic()
    named: list[dict[str, int]] = []
    assert queries.stop_at_boundary(60, after_commit=True, on_last=named.append)
    assert named == [{}]  # no batch begun, none named: its follower replays up to the park, as before a move
    assert time.monotonic() - began < 5  # not the two intervals (20 s) a batch would have been waited for
    assert last_offsets(root / "slow") is None


def test_a_trigger_interval_is_read_as_spark_writes_it() -> None:
    assert [interval_seconds(t) for t in ("1 second", "5 seconds", "500 milliseconds", "interval 2 minutes",
                                          "0 seconds", "2 days", "1.5 hours")] == [1, 5, 0.5, 120, 0, 172800, 5400]
    assert interval_seconds("every now and then") is None and interval_seconds("3 fortnights") is None


@pytest.mark.parametrize(("took_ms", "after"), [(900, 7), (1000, 6), (1400, 6)], ids=["within", "whole", "over"])
def test_a_followed_moves_stop_waits_past_the_running_batch_unless_batches_run_back_to_back(
        tmp_path: Path, took_ms: int, after: int) -> None:
    """Batch 7 planned, 6 committed, at a 1 s trigger (the demo's; the tests' jobs run at 2 s, so their batches
    rarely fill it): where the last batches each took the whole interval the next is planned the moment one commits,
    so the stop waits past the last commit; otherwise past the running batch, which is then the last the old run
    writes. The query's progress is Spark's, as `recentProgress` gives it; no Spark runs here."""
    stage = tmp_path / "totals"
    for log, batches in (("offsets", (5, 6, 7)), ("commits", (5, 6))):
        (stage / log).mkdir(parents=True)
        for batch in batches:
            (stage / log / str(batch)).write_text("v1\n{}\n")
    queries = StageQueries([Stage("totals", None, None, "update", "1 second")], tmp_path, "sqlite://", "j", 1)
    queries.queries["totals"] = type("Query", (), {"recentProgress": [
        {"durationMs": {"triggerExecution": took_ms}, "numInputRows": 4}] * 3})()
    assert queries._stop_after("totals", 6, fresh=True) == after
    assert queries._stop_after("totals", 6, fresh=False) == 6  # without a follower, always the last commit
