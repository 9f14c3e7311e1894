"""Spark's own repartition of a stopped stage checkpoint's state, as a run does it before its queries start
(`state_partitions.rescale`, which calls Spark 4.2's `StreamingCheckpointManager.repartition`), on the local session
in the test's process (conftest's `local_spark`): a stateful count on the RocksDB state store with 4 partitions, its
stopped checkpoint repartitioned to 2, then the query resumed on it with more input, the counts exact.

The decisions around it, without Spark, are tests/test_rescale_decisions.py's; update_job's whole rescale of a job
through the scheduler, both ways and with a failed try rolled back, is tests/e2e/test_airflow_upgrade.py's
test_update_job_grows_a_jobs_state_partitions_exact_and_a_failed_shrink_rolls_back (make test-e2e)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from changeover.runtime import state_partitions
from changeover.runtime.state_partitions import PARTITIONS, PROVIDER, ROCKSDB

pytestmark = pytest.mark.slow
WORDS = [f"w{n:02d}" for n in range(24)]  # keys enough to spread over every partition, before and after


def _write(landing: Path, part: int, words: list[str]) -> None:
    landing.mkdir(parents=True, exist_ok=True)
    (landing / f"part-{part}.json").write_text("".join(json.dumps({"word": w}) + "\n" for w in words))


def _run(spark: Any, landing: Path, stage: Path, seen: dict[str, int]) -> list[int]:
    """The count per word over the input not yet read (trigger availableNow), until it is all read: each batch's
    updated counts go into `seen`. Returns the ids of the batches its sink got."""
    batches: list[int] = []

    def collect(frame: Any, batch_id: int) -> None:
        batches.append(batch_id)
        seen.update({row["word"]: row["count"] for row in frame.collect()})

    counts = spark.readStream.schema("word string").json(str(landing)).groupBy("word").count()
    query = (counts.writeStream.outputMode("update").option("checkpointLocation", str(stage))
             .foreachBatch(collect).trigger(availableNow=True).start())
    query.awaitTermination()
    assert query.exception() is None
    return batches


def test_a_stopped_rocksdb_stages_state_is_repartitioned_and_the_resumed_query_counts_exact(
        local_spark: Any, tmp_path: Path) -> None:
    spark, landing, stage = local_spark, tmp_path / "landing", tmp_path / "checkpoint" / "counts"
    first = [word for n, word in enumerate(WORDS) for _ in range(n % 3 + 1)]  # every word, 1 to 3 times
    second = WORDS[::2] + WORDS[::3] + ["new"]  # words counted before (their state is needed), and a new one
    before = {key: spark.conf.get(key, None) for key in (PARTITIONS, PROVIDER)}
    spark.conf.set(PARTITIONS, "4")  # pinned in the offset log with the provider at the stage's first batch
    spark.conf.set(PROVIDER, ROCKSDB)
    try:
        seen: dict[str, int] = {}
        _write(landing, 0, first)
        assert _run(spark, landing, stage, seen) == [0]
        assert seen == Counter(first)
        assert (state_partitions.partitions(stage), state_partitions.provider(stage)) == (4, ROCKSDB)

        spark.conf.set(PARTITIONS, "3")  # the session's own count: the stage keeps the one its log pins
        assert state_partitions.rescale(spark, stage, 2) == (4, 1)  # the old count, and the repartition's batch
        assert state_partitions.partitions(stage) == 2 and state_partitions.is_repartition(stage, 1)
        assert state_partitions.rescale(spark, stage, 2) is None  # a repeat (a crash after it) changes nothing

        _write(landing, 1, second)
        assert _run(spark, landing, stage, seen) == [2]  # batch 1 was the repartition's: it read no input
        assert seen == Counter(first + second)  # every count went on from the state as it was, repartitioned
        assert state_partitions.partitions(stage, 2) == 2
    finally:
        for key, value in before.items():
            if value is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, value)
