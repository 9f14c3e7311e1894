"""What a zero-downtime move decides from checkpoint files, without Spark: how far a follower is behind, how many
batches it has replayed itself, and how long each input file waited for the sink around a move. The checkpoints
here are written in Spark's own layout (offset log v1, a file source's log, commit files), with their times set."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from changeover.errors import ChangeoverError
from changeover.jobs import freshness
from changeover.runtime import checkpoints
from changeover.runtime.follower import lag, replayed_since
from changeover.upgrade import zero_downtime

T0 = 1_800_000_000.0  # the checkpoints' clock, in POSIX seconds


def batch(stage: Path, number: int, log_offset: int, files: dict[int, float], committed_at: float | None) -> None:
    """Batch `number` read the file source's log entries after the last batch's, up to `log_offset`: `files` gives,
    per entry, when its one file arrived. Committed at `committed_at`, or planned only (None)."""
    for folder in ("offsets", "commits", "sources/0"):
        (stage / folder).mkdir(parents=True, exist_ok=True)
    (stage / "offsets" / str(number)).write_text(
        'v1\n{"batchWatermarkMs":0,"batchTimestampMs":0,"conf":{}}\n' + json.dumps({"logOffset": log_offset}) + "\n")
    for entry, arrived in files.items():
        line = {"path": f"file:///in/{entry}.json", "timestamp": int(arrived * 1000), "batchId": entry}
        (stage / "sources" / "0" / str(entry)).write_text("v1\n" + json.dumps(line) + "\n")
    if committed_at is not None:
        commit = stage / "commits" / str(number)
        commit.write_text('v1\n{"nextBatchWatermarkMs":0}\n')
        os.utime(commit, (committed_at, committed_at))


def test_the_largest_wait_around_a_move_is_the_file_that_arrived_as_the_old_run_stopped(tmp_path: Path) -> None:
    before, after = tmp_path / "old" / "counts", tmp_path / "new" / "counts"
    for n in range(4):  # one file a second, each committed 1.2 s after it arrived
        batch(before, n, n, {n: T0 + n}, T0 + n + 1.2)
    batch(before, 2, 2, {2: T0 + 2}, T0 + 11.0)  # a stall of the old run before the move (an executor lost): not its
    # the new run's checkpoint holds the old one's batches (a restored savepoint), then its own
    for n in range(4):
        batch(after, n, n, {n: T0 + n}, T0 + n + 1.2)
    batch(after, 4, 6, {4: T0 + 3.5, 5: T0 + 4.5, 6: T0 + 5.5}, T0 + 6.0)  # the cut-over: 3 files waited
    batch(after, 5, 7, {7: T0 + 6.5}, T0 + 7.4)
    assert freshness.largest_gap(before, after) == pytest.approx(2.5, abs=0.01)  # the file of T0 + 3.5
    assert freshness.of_move(str(tmp_path / "old"), str(tmp_path / "new")) == pytest.approx(2.5, abs=0.01)
    assert freshness.arrivals(after, 4) == [pytest.approx(T0 + 3.5), pytest.approx(T0 + 4.5), pytest.approx(T0 + 5.5)]


def test_a_move_of_a_stage_without_file_input_has_no_freshness(tmp_path: Path) -> None:
    for root, batches in (("old", range(2)), ("new", range(4))):
        stage = tmp_path / root / "rates"
        (stage / "commits").mkdir(parents=True)
        (stage / "offsets").mkdir()
        for n in batches:
            (stage / "commits" / str(n)).write_text("v1\n{}\n")
            (stage / "offsets" / str(n)).write_text('v1\n{}\n{"0":5}\n')  # a source of another kind
    assert freshness.largest_gap(tmp_path / "old" / "rates", tmp_path / "new" / "rates") is None
    assert freshness.of_move(str(tmp_path / "old"), str(tmp_path / "new")) is None
    assert freshness.of_move(None, str(tmp_path / "new")) is None


def test_an_entry_spark_compacted_away_is_read_from_the_compaction_and_a_purged_batch_gives_no_figure(
        tmp_path: Path) -> None:
    before, after = tmp_path / "old" / "counts", tmp_path / "new" / "counts"
    for stage in (before, after):
        for n in range(3):
            batch(stage, n, n, {n: T0 + n}, T0 + n + 1.0)
    batch(after, 3, 3, {3: T0 + 2.0}, T0 + 6.0)
    # the file source compacted its log at 9 and deleted entry 3: the compaction holds every entry, each once
    compacted = [{"path": f"file:///in/{n}.json", "timestamp": int((T0 + (2.0 if n == 3 else n)) * 1000),
                  "batchId": n} for n in range(10)]
    (after / "sources" / "0" / "9.compact").write_text("v1\n" + "\n".join(json.dumps(c) for c in compacted))
    (after / "sources" / "0" / "3").unlink()
    assert freshness.arrivals(after, 3) == [pytest.approx(T0 + 2.0)]  # its own line only, not the whole log
    assert freshness.largest_gap(before, after) == pytest.approx(4.0, abs=0.01)
    (after / "offsets" / "2").unlink()  # purged: which entries batch 3 read is no longer known
    assert freshness.arrivals(after, 3) is None
    assert freshness.largest_gap(before, after) is None  # not the old run's side alone


def test_lag_and_replays_count_commits_not_offsets(tmp_path: Path) -> None:
    leader, follower = tmp_path / "leader", tmp_path / "follower"
    for n in range(6):
        batch(leader / "counts", n, n, {n: T0 + n}, T0 + n + 1)
    batch(leader / "counts", 6, 6, {6: T0 + 6}, None)  # planned, not committed: not yet followable
    for n in range(3):  # restored from a savepoint: links to files committed before it followed
        batch(follower / "counts", n, n, {n: T0 + n}, T0 + n + 1)
    batch(follower / "counts", 3, 3, {3: T0 + 3}, T0 + 100)  # its own replay, after it began following
    assert lag(leader, follower, ["counts"]) == {"counts": 2}
    assert lag(leader, follower, ["idle"]) == {"idle": 0}  # a stage neither has committed
    assert replayed_since(follower, ["counts"], T0 + 50) == {"counts": 1}
    assert checkpoints.last_commit(follower / "counts") == 3


def test_a_move_strategy_must_be_one_changeover_knows() -> None:
    assert zero_downtime.strategy_of(None, {}) == "warm"
    assert zero_downtime.strategy_of(None, {"move_strategy": "zero_downtime"}) == "zero_downtime"
    assert zero_downtime.strategy_of("warm", {"move_strategy": "zero_downtime"}) == "warm"  # the DAG's Param wins
    with pytest.raises(ChangeoverError, match=r"move strategy 'instant': the strategies are warm, zero_downtime"):
        zero_downtime.strategy_of("instant", {})
