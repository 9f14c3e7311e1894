"""Rescaling state, the decisions without Spark: the count and the store read from offset log entries in Spark's
layout, the findings per stage before anything stops, the planned batch set aside and put back after the
repartition's own, and the refusals of a resume (SQLite and PostgreSQL for the registry's part).

Spark's repartition itself runs in make test in tests/test_state_rescale.py (a stopped RocksDB checkpoint
repartitioned from 4 partitions to 2 on a local session, the resumed query's counts exact), in tests/e2e under make
test-e2e (update_job grows a real job's state, and a failed try shrinks it) and in the version table's measurement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from changeover import jobs
from changeover.cluster import LocalCluster
from changeover.compat import rescale_check
from changeover.compat.checker import Report
from changeover.compat.rules import Verdict
from changeover.errors import ChangeoverError
from changeover.runtime import checkpoints, state_partitions
from changeover.runtime.sinks.base import WriteContext
from changeover.runtime.sinks.files import BATCHES, Files
from changeover.runtime.state_partitions import HDFS, PARTITIONS, PROVIDER, ROCKSDB, SET_ASIDE, state_store_confs
from changeover.settings import Settings
from changeover.upgrade import code_update


def _entry(partitions: int, provider: str | None, log_offset: int) -> str:
    conf = {PARTITIONS: str(partitions), **({PROVIDER: provider} if provider else {})}
    return "\n".join(["v1", json.dumps({"batchWatermarkMs": 0, "batchTimestampMs": 1, "conf": conf}),
                      json.dumps({"logOffset": log_offset})])


def _stage(folder: Path, committed: int, partitions: int = 4, provider: str | None = ROCKSDB,
           planned: int | None = None, state: bool = True) -> Path:
    """A stage checkpoint as Spark leaves it: batches 0..committed, each with offsets and a commit, and maybe a
    planned batch (offsets only) with `planned` partitions."""
    for name in ("offsets", "commits"):
        (folder / name).mkdir(parents=True, exist_ok=True)
    for batch in range(committed + 1):
        (folder / "offsets" / str(batch)).write_text(_entry(partitions, provider, batch))
        (folder / "commits" / str(batch)).write_text('v1\n{"nextBatchWatermarkMs":0}')
    if planned is not None:
        (folder / "offsets" / str(committed + 1)).write_text(_entry(planned, provider, committed + 1))
        (folder / "offsets" / f".{committed + 1}.crc").write_bytes(b"crc")
    if state:
        (folder / "state" / "0" / "0").mkdir(parents=True)
    return folder


def _savepoint(tmp_path: Path, **stages: dict) -> Path:
    for name, shape in stages.items():
        _stage(tmp_path / "sp" / "stages" / name, **shape)
    return tmp_path / "sp"


def test_the_count_and_the_store_are_read_from_the_last_committed_batch(tmp_path: Path) -> None:
    rocks = _stage(tmp_path / "rocks", committed=3, partitions=4, planned=8)
    assert state_partitions.partitions(rocks) == 4  # the planned batch is not committed
    assert state_partitions.partitions(rocks, 4) == 8
    assert state_partitions.provider(rocks) == ROCKSDB
    default = _stage(tmp_path / "default", committed=0, provider=None)
    assert state_partitions.provider(default) == HDFS  # Spark's default store when the log names none
    assert state_partitions.partitions(tmp_path / "never-ran") is None


def test_each_stage_is_found_movable_kept_or_refused_with_its_rule_and_fix(tmp_path: Path) -> None:
    saved = _savepoint(tmp_path, counts={"committed": 2}, same={"committed": 2, "partitions": 8},
                       old_store={"committed": 2, "provider": None}, stateless={"committed": 2, "state": False})
    report = Report("orders", "orders/sp")
    moving = rescale_check.add_findings(report, saved, ["counts", "same", "old_store", "stateless"], "4.2.0", 8)
    assert moving == ["counts"]
    found = {(f.rule, f.stage): f for f in report.findings}
    assert set(found) == {("CO-SCALE-04", "counts"), ("CO-SCALE-04", "same"), ("CO-SCALE-01", "old_store")}
    assert "4 -> 8 partitions" in found["CO-SCALE-04", "counts"].detail
    assert "8 partitions already" in found["CO-SCALE-04", "same"].detail
    refused = found["CO-SCALE-01", "old_store"]
    assert refused.verdict == Verdict.INCOMPATIBLE and "HDFSBackedStateStoreProvider" in refused.detail
    assert "state_store: rocksdb" in refused.fix
    assert report.verdict == Verdict.INCOMPATIBLE


def test_a_version_that_cannot_repartition_is_refused_for_every_stage(tmp_path: Path) -> None:
    saved = _savepoint(tmp_path, counts={"committed": 1})
    report = Report("orders", "orders/sp")
    rescale_check.add_findings(report, saved, ["counts"], "3.5.1", 2)
    assert [(f.rule, f.stage) for f in report.findings if f.verdict == Verdict.INCOMPATIBLE] == [
        ("CO-SCALE-02", "(every stage)")]
    assert "Spark 3.5.1: not measured" in report.findings[0].detail
    with pytest.raises(ChangeoverError, match=r"state partitions 0: .* at least one partition"):
        rescale_check.add_findings(Report("orders", "orders/sp"), saved, ["counts"], "4.2.0", 0)


def test_a_resume_is_refused_before_anything_is_laid_out_naming_the_rule_and_the_fix(tmp_path: Path) -> None:
    saved = _savepoint(tmp_path, counts={"committed": 1, "provider": None})
    before = sorted(p.relative_to(saved) for p in saved.rglob("*"))
    with pytest.raises(ChangeoverError, match=r"resume of job orders from savepoint sp with 2 state partitions: "
                                              r"\[INCOMPATIBLE\] CO-SCALE-01 job orders, stage counts.*"
                                              r"state_store: rocksdb"):
        rescale_check.require("orders", "sp", saved, "4.2.0", 2)
    assert sorted(p.relative_to(saved) for p in saved.rglob("*")) == before
    assert rescale_check.require("orders", "sp", _savepoint(tmp_path / "ok", counts={"committed": 1}), "4.2.0",
                                 2) == ["counts"]


def _repartitioned(stage: Path, batch: int, count: int, log_offset: int) -> None:
    """What Spark's repartition writes: `batch`, with the offsets of the batch before it and the new count."""
    (stage / "offsets" / str(batch)).write_text(_entry(count, ROCKSDB, log_offset))
    (stage / "commits" / str(batch)).write_text('v1\n{"nextBatchWatermarkMs":0}')


def test_the_planned_batch_is_set_aside_and_put_back_after_the_repartitions_own(tmp_path: Path) -> None:
    stage = _stage(tmp_path / "stage", committed=5, partitions=4, planned=4)
    planned = (stage / "offsets" / "6").read_text()
    state_partitions.set_pending_aside(stage, 5)
    assert not (stage / "offsets" / "6").exists() and not (stage / "offsets" / ".6.crc").exists()
    assert state_partitions.set_aside_entry(stage) == planned.splitlines()
    # A crash inside Spark's repartition leaves its own uncommitted batch 6 (count 8); the driver's retry keeps the
    # planned batch set aside as it was, and Spark retries its repartition.
    (stage / "offsets" / "6").write_text(_entry(8, ROCKSDB, 5))
    state_partitions.set_pending_aside(stage, 5)
    assert state_partitions.set_aside_entry(stage) == planned.splitlines()
    _repartitioned(stage, 6, 8, 5)
    assert state_partitions.put_pending_back(stage, 8) == 7
    lines = (stage / "offsets" / "7").read_text().splitlines()
    assert lines[0] == "v1" and lines[2:] == planned.splitlines()[2:]  # the same input as planned
    assert json.loads(lines[1])["conf"][PARTITIONS] == "8"  # with the count its state now has
    assert not (stage / SET_ASIDE).exists()
    assert state_partitions.put_pending_back(stage, 8) is None  # nothing left to do on a repeat


def test_a_set_aside_batch_is_put_back_only_right_after_the_repartition_it_waited_for(tmp_path: Path) -> None:
    """An old set-aside entry (a copy of a checkpoint long after) would replay input from long ago: refused."""
    stage = _stage(tmp_path / "stage", committed=2, partitions=4, planned=4)
    state_partitions.set_pending_aside(stage, 2)
    for batch in (3, 4, 5):  # batches that read input, not a repartition
        (stage / "offsets" / str(batch)).write_text(_entry(4, ROCKSDB, batch))
        (stage / "commits" / str(batch)).write_text('v1\n{"nextBatchWatermarkMs":0}')
    with pytest.raises(ChangeoverError, match=r"set aside after batch 2 for a repartition, but its last commit is 5, "
                                              r"not that repartition's own batch.*resume the job from its savepoint"):
        state_partitions.put_pending_back(stage, 8)
    assert not (stage / "offsets" / "6").exists()


def test_a_copy_of_a_rescale_cut_short_keeps_the_set_aside_batch_and_its_input(tmp_path: Path) -> None:
    """A run continuing one whose driver died between the repartition and the write-back copies the set-aside batch
    with the file source's log entries it reads (a savepoint never does: the root is marked meanwhile)."""
    stage = _stage(tmp_path / "run" / "stage", committed=5, partitions=4, planned=4)
    (stage / "sources" / "0").mkdir(parents=True)
    for entry in range(7):
        (stage / "sources" / "0" / str(entry)).write_text("v1\n{}")
    state_partitions.set_pending_aside(stage, 5)
    _repartitioned(stage, 6, 8, 5)  # committed: the batch after it is the set-aside one
    copy = tmp_path / "copy" / "stage"
    checkpoints.snapshot_stage(stage, copy, 6)
    assert not (copy / SET_ASIDE).exists()  # never a file of the state
    assert not (copy / "sources" / "0" / "6").exists()
    checkpoints.snapshot_pending(stage, copy, 6)
    assert (copy / SET_ASIDE).exists() and (copy / "sources" / "0" / "6").exists()
    assert state_partitions.put_pending_back(copy, 8) == 7  # what the continuing driver does first


def test_a_repartition_spark_left_unfinished_stays_for_spark_to_retry(tmp_path: Path) -> None:
    """A planned batch with another count than the last commit is the repartition's own, cut short: Spark retries
    it with the same count (LAST_BATCH_ABANDONED_REPARTITION), so it is not taken for input to replay."""
    stage = _stage(tmp_path / "stage", committed=5, partitions=4, planned=8)
    state_partitions.set_pending_aside(stage, 5)
    assert (stage / "offsets" / "6").exists() and not (stage / SET_ASIDE).exists()


def test_rescale_does_nothing_for_a_stage_without_state_or_already_at_the_count(tmp_path: Path) -> None:
    class NoSpark:  # Spark must not be called: any attribute read fails the test
        def __getattr__(self, name: str) -> None:
            raise AssertionError(f"Spark was asked for {name}")

    assert state_partitions.rescale(NoSpark(), _stage(tmp_path / "a", committed=2, state=False), 8) is None
    assert state_partitions.rescale(NoSpark(), _stage(tmp_path / "b", committed=2, partitions=8), 8) is None
    assert state_partitions.rescale(NoSpark(), tmp_path / "never-ran", 8) is None


def test_a_job_option_names_a_known_store_and_a_count_needs_a_savepoint(settings: Settings, tmp_path: Path) -> None:
    assert state_store_confs({"state_store": "rocksdb"}) == {PROVIDER: ROCKSDB}
    assert state_store_confs({}) == {}
    with pytest.raises(ChangeoverError, match=r"job option state_store 'rocks': Changeover knows hdfs, rocksdb"):
        jobs.submit(settings, LocalCluster(settings), "jobs.clicks", "orders", options={"state_store": "rocks"})
    with pytest.raises(ChangeoverError, match=r"submit of job orders with 8 state partitions: a new count applies "
                                              r"to state restored from a savepoint.*--from-savepoint"):
        jobs.submit(settings, LocalCluster(settings), "jobs.clicks", "orders", state_partitions=8)
    assert jobs.list_jobs(settings) == []  # nothing was created


def test_a_repartitions_own_batch_is_told_from_a_batch_that_read_input(tmp_path: Path) -> None:
    """What the file sink fills its log's gap with: only a committed batch with a new count and the offsets of the
    batch before it; a missing batch of any other kind is lost rows, which the sink refuses."""
    stage = _stage(tmp_path / "stage", committed=3, partitions=4)
    (stage / "offsets" / "4").write_text(_entry(8, ROCKSDB, 3))  # the repartition's: batch 3's offsets, count 8
    (stage / "commits" / "4").write_text('v1\n{"nextBatchWatermarkMs":0}')
    (stage / "offsets" / "5").write_text(_entry(8, ROCKSDB, 4))  # the planned batch, put back
    (stage / "commits" / "5").write_text('v1\n{"nextBatchWatermarkMs":0}')
    assert [b for b in range(7) if state_partitions.is_repartition(stage, b)] == [4]


def test_the_file_sink_fills_a_repartitions_gap_and_refuses_any_other(tmp_path: Path) -> None:
    """Spark's sink log compacts an unbroken run of entries: the repartition's batch gets an empty one. Any other
    missing batch would be rows lost, refused by name (the log writes themselves need Spark: tests/e2e)."""
    stage = _stage(tmp_path / "stage", committed=3, partitions=4)
    _repartitioned(stage, 4, 8, 3)
    (stage / "offsets" / "5").write_text(_entry(8, ROCKSDB, 4))
    sink = Files(str(tmp_path / "out"))
    sink.log.mkdir(parents=True)
    for batch in range(4):
        (sink.log / str(batch)).write_text("v1")
    context = WriteContext("sqlite://", "orders", "counts", 7, checkpoint=str(stage))
    assert sink._repartitions_before(context, 5) == [4]
    assert sorted(p.name for p in (sink.root / BATCHES).iterdir()) == ["4.run7"]
    assert sink._repartitions_before(context, 4) == []
    (sink.log / "1").unlink()
    (sink.log / "2").unlink()
    (sink.log / "3").unlink()
    with pytest.raises(ChangeoverError, match=r"the sink's log ends at batch 0, and batches \[1, 2, 3\] are neither in "
                                              r"it nor a repartition"):
        sink._repartitions_before(context, 5)


def test_an_update_that_only_changed_the_count_is_told_by_the_state_itself(tmp_path: Path) -> None:
    """What a rollback of update_job looks at when the code did not change: whichever run holds the job now (the
    update's, one continuing it, a move's), its stages' counts against the savepoint's."""
    saved = _savepoint(tmp_path, counts={"committed": 3}, stateless={"committed": 3, "state": False})
    kept = _stage(tmp_path / "kept" / "counts", committed=5, partitions=4)
    assert not code_update.repartitioned_since(saved, kept.parent)
    moved = _stage(tmp_path / "moved" / "counts", committed=3, partitions=4)
    _repartitioned(moved, 4, 2, 3)
    assert code_update.repartitioned_since(saved, moved.parent)
