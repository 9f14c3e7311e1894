"""A user's foreachBatch function behind the fence, on a real streaming query (a local session) and a real registry.

A replayed batch (a move's successor replays the batch its predecessor had begun) is delivered again, as the
declared at-least-once guarantee allows, with the same rows, and the query goes on from its state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from changeover.runtime import ForeachBatch
from changeover.runtime.sinks import WriteContext
from changeover.settings import Settings
from conftest import current_run

pytestmark = pytest.mark.slow


def test_a_replayed_batch_is_delivered_again_with_the_same_rows_and_the_query_goes_on(
        local_spark: Any, settings: Settings, tmp_path: Path) -> None:
    run_id = current_run(settings.database_url, "j")
    delivered: list[tuple[int, list[tuple[str, int]]]] = []

    def users_function(batch: Any, batch_id: int) -> None:
        delivered.append((batch_id, sorted((r["key"], r["count"]) for r in batch.collect())))

    sink = ForeachBatch(users_function, guarantee="at-least-once")
    landing, checkpoint = tmp_path / "in", tmp_path / "checkpoint"
    landing.mkdir()

    def land(name: str, keys: list[str]) -> None:
        (landing / f"{name}.json").write_text("".join(f'{{"key": "{k}"}}\n' for k in keys))

    def run_until_caught_up() -> None:
        counts = (local_spark.readStream.schema("key string").json(str(landing))
                  .groupBy("key").count())
        query = (sink.attach(counts, WriteContext(settings.database_url, "j", "counts", run_id))
                 .outputMode("update").option("checkpointLocation", str(checkpoint)).start())
        try:
            query.processAllAvailable()
        finally:
            query.stop()

    land("0", ["a", "b"])
    run_until_caught_up()
    land("1", ["a"])
    run_until_caught_up()
    assert delivered == [(0, [("a", 1), ("b", 1)]), (1, [("a", 2)])]
    for logged in ("1", ".1.crc"):  # the stop's window: batch 1 delivered, its commit not yet logged
        (checkpoint / "commits" / logged).unlink()
    land("2", ["b", "c"])
    run_until_caught_up()
    # batch 1 replayed with its own rows, then batch 2 counted on batch 1's state
    assert delivered[2:] == [(1, [("a", 2)]), (2, [("b", 2), ("c", 1)])]
    assert (checkpoint / "commits" / "2").is_file()
