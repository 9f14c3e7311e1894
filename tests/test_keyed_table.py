"""The keyed SQL table sink on real Spark DataFrames (a local session) and a real database, SQLite and PostgreSQL.

The batches are written the way a query's foreachBatch hands them over: executors stage each partition,
the driver merges inside the fence. Rows are never collected on the driver.
"""

from __future__ import annotations

from typing import Any

import pytest
from changeover import audit
from changeover.errors import ChangeoverError
from changeover.handoff.fence import Fenced
from changeover.registry.db import session_scope
from changeover.registry.models import Job
from changeover.runtime import KeyedTable
from changeover.runtime.sinks import WriteContext
from changeover.settings import Settings
from conftest import current_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def spark(local_spark: Any) -> Any:
    return local_spark


def _current_run(settings: Settings, job: str = "j") -> int:
    return current_run(settings.database_url, job)


def _write(spark: Any, sink: KeyedTable, settings: Settings, run: int, batch: int, rows: list[tuple[Any, ...]],
           columns: str = "key string, total long") -> bool:
    frame = spark.createDataFrame(rows, columns).repartition(3)
    return sink.write(frame, batch, WriteContext(settings.database_url, "j", "totals", run))


def _table(sink: KeyedTable) -> dict[str, int]:
    return {row["key"]: row["total"] for row in sink.read()}


def test_batches_upsert_by_key_and_a_replayed_batch_changes_nothing(spark: Any, settings: Settings) -> None:
    sink, run = KeyedTable(settings.database_url, "totals", keys=("key",), chunk_rows=2), _current_run(settings)
    assert _write(spark, sink, settings, run, 0, [("a", 1), ("b", 2), ("c", 3), ("d", 4), ("e", 5)])
    assert not _write(spark, sink, settings, run, 0, [("a", 100)])  # the replay of batch 0
    assert _write(spark, sink, settings, run, 1, [("a", 10), ("f", 6)])
    assert _table(sink) == {"a": 10, "b": 2, "c": 3, "d": 4, "e": 5, "f": 6}
    assert sink.progress(WriteContext(settings.database_url, "j", "totals", run)) == 1
    with session_scope(settings.database_url) as s:
        assert s.execute(sink.tables().staging.select()).all() == []  # merged batches leave no staging rows


def test_two_attempts_of_one_partition_that_both_staged_merge_once(settings: Settings) -> None:
    """A speculative copy, or a zombie attempt after a false executor loss, stages partition 0 beside the attempt
    Spark accepted: only the accepted attempts' rows are merged (before, the merge refused the good batch as "keys
    occur more than once"). Spark cannot be made to finish two attempts of one task at will, so the executors'
    staging step is called here as each attempt calls it."""
    from changeover.runtime.sinks.keyed_table import stage_rows
    from pyspark.sql import Row
    from pyspark.sql.types import LongType, StringType, StructField, StructType

    sink, run = KeyedTable(settings.database_url, "totals", keys=("key",)), _current_run(settings)
    tables = sink.tables(StructType([StructField("key", StringType()), StructField("total", LongType())]))
    for part, attempt, rows in [(0, 7, [Row(key="a", total=1), Row(key="b", total=1)]),
                                (0, 9, [Row(key="a", total=2), Row(key="b", total=2)]),
                                (1, 8, [Row(key="c", total=3)])]:
        stage_rows(settings.database_url, tables.staging.name, ["key", "total"], "j/totals", 0, run, 100, part,
                   attempt, rows)
    context = WriteContext(settings.database_url, "j", "totals", run)

    assert sink._merge_fenced(tables, context, "j/totals", 0, [(0, 9), (1, 8)])
    assert _table(sink) == {"a": 2, "b": 2, "c": 3}
    with session_scope(settings.database_url) as s:
        assert s.execute(sink.tables().staging.select()).all() == []  # the other attempt's rows are gone too


def test_a_sink_in_another_database_refuses_an_older_epoch_though_the_registry_lost_the_newer_owner(
        settings: Settings, tmp_path: Any, pg_database: Any) -> None:
    """The sink's database keeps the newest epoch that merged there, checked in the merge's own transaction: the
    registry lost the record of the run that wrote last (as a crash between the sink's commit and the registry's can
    leave it), and the older run it made current again is refused by the sink itself."""
    from changeover.runtime.sinks.keyed_table import stage_rows
    from pyspark.sql import Row
    from pyspark.sql.types import LongType, StringType, StructField, StructType

    elsewhere = (pg_database("changeover_sink") if settings.database_url.startswith("postgresql")
                 else f"sqlite:///{tmp_path / 'users.db'}")
    sink = KeyedTable(elsewhere, "totals", keys=("key",))
    tables = sink.tables(StructType([StructField("key", StringType()), StructField("total", LongType())]))

    def merge(run: int, batch: int, total: int) -> bool:
        stage_rows(elsewhere, tables.staging.name, ["key", "total"], "j/totals", batch, run, 100, 0, 1,
                   [Row(key="a", total=total)])
        return sink._merge_fenced(tables, WriteContext(settings.database_url, "j", "totals", run), "j/totals",
                                  batch, [(0, 1)])

    older = _current_run(settings)
    assert merge(older, 0, 1)
    newer = _current_run(settings)
    assert merge(newer, 1, 2)
    with session_scope(settings.database_url) as s:  # the registry forgets the newer owner
        s.get(Job, "j").current_run_id = older

    with pytest.raises(Fenced, match="the sink's own database has merged a batch of epoch"):
        merge(older, 2, 100)  # a batch the ledger does not have: only the epoch refuses it
    assert _table(sink) == {"a": 2}
    assert [e.action for e in audit.find(settings.database_url, job="j")][-1] == "sink.fenced"


def test_the_ledger_check_under_the_fence_skips_a_replay_that_raced_past_the_first_check(
        spark: Any, settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    sink, run = KeyedTable(settings.database_url, "totals", keys=("key",)), _current_run(settings)
    assert _write(spark, sink, settings, run, 0, [("a", 1)])
    # Two tries of batch 0 both passed the cheap check before either merged: the one inside the fence decides.
    monkeypatch.setattr(KeyedTable, "_written", lambda *args: False)
    assert not _write(spark, sink, settings, run, 0, [("a", 100)])
    assert _table(sink) == {"a": 1}


def test_a_rewind_restores_the_values_as_of_a_batch_not_an_empty_table(spark: Any, settings: Settings) -> None:
    sink, run = KeyedTable(settings.database_url, "totals", keys=("key",)), _current_run(settings)
    context = WriteContext(settings.database_url, "j", "totals", run)
    _write(spark, sink, settings, run, 0, [("a", 1), ("b", 2)])
    _write(spark, sink, settings, run, 1, [("a", 3), ("c", 5)])
    _write(spark, sink, settings, run, 2, [("b", 7), ("c", 8)])
    sink.rewind(context, 1, None)
    assert _table(sink) == {"a": 3, "b": 2, "c": 5} and sink.progress(context) == 1
    sink.rewind(context, 0, None)
    assert _table(sink) == {"a": 1, "b": 2} and sink.progress(context) == 0
    assert _write(spark, sink, settings, run, 1, [("a", 4)])  # batch 1 is written again, not skipped
    assert _table(sink) == {"a": 4, "b": 2}
    sink.rewind(context, None, None)
    assert _table(sink) == {} and sink.progress(context) is None


def test_a_superseded_run_cannot_write_and_its_attempt_is_recorded(spark: Any, settings: Settings) -> None:
    sink = KeyedTable(settings.database_url, "totals", keys=("key",))
    stale = _current_run(settings)
    _write(spark, sink, settings, stale, 0, [("a", 1)])
    current = _current_run(settings)
    with pytest.raises(Fenced, match=f"by run {stale}: run {current} is the job's current run"):
        _write(spark, sink, settings, stale, 1, [("a", 100)])
    assert _table(sink) == {"a": 1}
    refused = [e for e in audit.find(settings.database_url, job="j") if e.action == "sink.fenced"]
    assert [(e.details["run"], e.details["batch"]) for e in refused] == [(stale, 1)]
    assert _write(spark, sink, settings, current, 1, [("a", 2)]) and _table(sink) == {"a": 2}


def test_bad_declarations_and_batches_are_refused_by_name(spark: Any, settings: Settings) -> None:
    run = _current_run(settings)
    sink = KeyedTable(settings.database_url, "totals", keys=("key",))
    with pytest.raises(ChangeoverError, match=r"1 key\(s\) of \(key\) occur more than once in the batch"):
        _write(spark, sink, settings, run, 0, [("a", 1), ("a", 2)])
    assert _table(sink) == {}
    with pytest.raises(ChangeoverError, match="the stage's rows have no column"):
        _write(spark, KeyedTable(settings.database_url, "other", keys=("id",)), settings, run, 0, [("a", 1)])
    nested = KeyedTable(settings.database_url, "nested", keys=("key",))
    with pytest.raises(ChangeoverError, match="a keyed table stores flat columns only"):
        _write(spark, nested, settings, run, 0, [("a", (1, 2))], "key string, pair struct<x:long,y:long>")
    with pytest.raises(ChangeoverError, match="names may only hold"):
        KeyedTable(settings.database_url, "drop table; --", keys=("key",))


def test_a_stateful_batch_replayed_after_its_write_still_runs_and_the_query_goes_on(
        spark: Any, settings: Settings, tmp_path: Any) -> None:
    """A driver killed after the sink's merge and before Spark's commit log: the restarted query replays that
    batch. The ledger skips the write, but the batch must still run its aggregation, or Spark 4.2 ends the
    query with STATE_STORE_COMMIT_VALIDATION_FAILED and the job cannot come back."""
    run = _current_run(settings)
    sink, landing, checkpoint = KeyedTable(settings.database_url, "replayed", keys=("key",)), tmp_path / "in", \
        tmp_path / "checkpoint"
    landing.mkdir()

    def land(name: str, keys: list[str]) -> None:
        (landing / f"{name}.json").write_text("".join(f'{{"key": "{k}"}}\n' for k in keys))

    def run_until_caught_up() -> None:
        frame = spark.readStream.schema("key string").option("maxFilesPerTrigger", 1).json(str(landing))
        totals = frame.groupBy("key").count().withColumnRenamed("count", "total")
        query = (sink.attach(totals, WriteContext(settings.database_url, "j", "totals", run)).outputMode("update")
                 .option("checkpointLocation", str(checkpoint)).start())
        try:
            query.processAllAvailable()
        finally:
            query.stop()

    land("0", ["a", "b"])
    land("1", ["a"])
    run_until_caught_up()
    assert _table(sink) == {"a": 2, "b": 1}
    for logged in ("1", ".1.crc"):  # the kill's window: batch 1 merged, its commit not yet logged
        (checkpoint / "commits" / logged).unlink()
    land("2", ["b", "c"])
    run_until_caught_up()
    assert _table(sink) == {"a": 2, "b": 2, "c": 1}  # batch 1 not counted twice, batch 2 counted on its state
    assert (checkpoint / "commits" / "2").is_file()


def test_every_column_type_and_null_round_trips_through_staging(spark: Any, settings: Settings) -> None:
    """PostgreSQL stages through COPY, whose text format each value must survive; SQLite through inserts."""
    import datetime
    import decimal

    sink, run = KeyedTable(settings.database_url, "typed", keys=("key",)), _current_run(settings)
    at = datetime.datetime(2026, 11, 26, 3, 4, 5, 678000, tzinfo=datetime.UTC)
    rows = [("a\tb\\n 'q' \"x\"", 2**40, 7, 1.5, True, at, datetime.date(2026, 1, 2), decimal.Decimal("12.345"),
             bytearray(b"\x00\xff\n")),
            ("nulls", None, None, None, None, None, None, None, None)]
    columns = ("key string, big long, small int, ratio double, flag boolean, at timestamp, day date, "
               "amount decimal(10,3), blob binary")
    assert _write(spark, sink, settings, run, 0, rows, columns)
    read = {row["key"]: row for row in sink.read()}
    first = read["a\tb\\n 'q' \"x\""]
    assert (first["big"], first["small"], first["ratio"], first["flag"]) == (2**40, 7, 1.5, True)
    stamp = first["at"] if first["at"].tzinfo else first["at"].replace(tzinfo=datetime.UTC)
    assert stamp == at
    assert (first["day"], first["amount"], bytes(first["blob"])) == (datetime.date(2026, 1, 2),
                                                                     decimal.Decimal("12.345"), b"\x00\xff\n")
    assert all(value is None for name, value in read["nulls"].items() if name != "key")
