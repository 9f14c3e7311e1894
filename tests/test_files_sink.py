"""The file sink is fenced inside its write: each batch is staged by Spark's batch writer, then its files are moved
into place and its `_spark_metadata` entry added under the job row's lock. So its write waits out a registry
restart and lands once, a superseded run's batch never reaches the log, and files placed but never logged (a
driver killed between the two) are never read.

The driver's loop runs in the test's process on a local Spark session, against a PostgreSQL registry of the test's
own, stopped and started again for the outage (a worker-hosted driver runs the same code).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from changeover import audit
from changeover.cluster import wait_for
from changeover.errors import ChangeoverError
from changeover.handoff.fence import Fenced
from changeover.registry.db import forget_engines, session_scope
from changeover.registry.models import Job
from changeover.registry.schema import migrate
from changeover.runtime.contract import Stage
from changeover.runtime.loop import Driver
from changeover.runtime.sinks import Files, WriteContext, files
from changeover.settings import Settings
from conftest import current_run
from pg_server import Server, own_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with own_server() as started:
        migrate(started.url)
        yield started


@pytest.fixture(scope="module")
def spark(local_spark: Any) -> Any:
    return local_spark


@contextmanager
def _running(url: str, driver: Driver, stage: Stage, root: Path, spark: Any) -> Iterator[None]:
    """The driver's loop on a thread of its own. Leaving, the job is asked to STOP, and the loop must end so; after
    a failure, a loop still running is fenced off, which stops its queries."""
    outcome: list[Any] = []
    loop = threading.Thread(target=lambda: outcome.append(driver.run_streaming([stage], root, spark=spark)),
                            daemon=True)
    loop.start()
    try:
        yield
        forget_engines()
        with session_scope(url) as s:
            s.get(Job, driver.job).desired = "STOP"
        loop.join(120)
        assert outcome == [True]
    finally:
        if loop.is_alive():
            with session_scope(url) as s:
                s.get(Job, driver.job).current_run_id = None
            loop.join(60)


def _land(landing: Path, name: str, keys: list[str]) -> None:
    landing.mkdir(exist_ok=True)
    (landing / f"{name}.json").write_text("".join(f'{{"key": "{k}"}}\n' for k in keys))


def _read(spark: Any, out: Path) -> list[str]:
    """What Spark's reader sees: the files the sink's log lists, and only those."""
    return sorted(r.key for r in spark.read.schema("key string").parquet(str(out)).collect()) if out.is_dir() else []


def test_a_file_sinks_batch_waits_out_a_registry_restart_and_lands_once(
        server: Server, spark: Any, tmp_path: Path) -> None:
    settings = Settings.from_env(home=tmp_path / "home", database_url=server.url)
    run_id = current_run(server.url, "outage", spark.version)
    landing, out = tmp_path / "landing", tmp_path / "out"
    _land(landing, "0", ["a", "b"])
    frame = spark.readStream.schema("key string").json(str(landing))
    sink = Files(str(out))
    driver = Driver(settings, "outage", run_id)
    with _running(server.url, driver, Stage("events", frame, sink, trigger="0.2 seconds"), tmp_path / "ckpt", spark):
        wait_for(lambda: _read(spark, out) == ["a", "b"], 120, "the first batch in the file sink")
        server.stop()
        try:
            _land(landing, "1", ["c"])  # its batch is staged, and waits for the registry to commit
            wait_for(lambda: any((out / files.STAGING).glob("*/*.parquet")), 60, "the second batch staged")
            assert _read(spark, out) == ["a", "b"]
        finally:
            server.start()
        wait_for(lambda: _read(spark, out) == ["a", "b", "c"], 120, "the staged batch committed once the registry "
                 "is back")
    assert sink.progress(WriteContext(server.url, "outage", "events", run_id)) == 1  # two batches, each once


def test_files_placed_but_never_logged_are_never_read_and_a_superseded_run_lands_nothing(
        server: Server, spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver killed between moving a batch's files into place and adding its log entry, played by a log write
    that raises (a SIGKILL at that point cannot be aimed from here)."""
    run_id = current_run(server.url, "placed", spark.version)
    out = tmp_path / "out"
    sink, context = Files(str(out), partition_by=("part",)), WriteContext(server.url, "placed", "events", run_id)
    batch = spark.createDataFrame([("a", 1), ("b", 2)], "key string, part int")
    assert sink.write(batch, 0, context)
    logged = set(out.rglob("run*.parquet"))
    add = files._add_to_log

    def killed(*args: Any) -> None:
        raise SystemExit("killed before the log entry")

    monkeypatch.setattr(files, "_add_to_log", killed)
    with pytest.raises(SystemExit):
        sink.write(spark.createDataFrame([("c", 1)], "key string, part int"), 1, context)
    placed = set(out.rglob("run*.parquet")) - logged
    assert placed and all(p.parent.name == "part=1" for p in placed)  # batch 1's file, in its partition's folder
    assert _read(spark, out) == ["a", "b"]

    monkeypatch.setattr(files, "_add_to_log", add)
    assert sink.write(spark.createDataFrame([("c", 1)], "key string, part int"), 1, context)
    assert not sink.write(spark.createDataFrame([("c", 1)], "key string, part int"), 1, context)  # a replay
    assert _read(spark, out) == ["a", "b", "c"]
    assert sink.progress(context) == 1

    successor = current_run(server.url, "placed", spark.version)  # the run is superseded: its batch never lands
    with pytest.raises(Fenced, match=f"write of batch 2 of stage events of job placed by run {run_id}"):
        sink.write(spark.createDataFrame([("d", 2)], "key string, part int"), 2, context)
    assert _read(spark, out) == ["a", "b", "c"] and sink.progress(context) == 1
    assert not list((out / files.STAGING).rglob("*.parquet"))  # what it staged is gone
    refused = [e for e in audit.find(server.url, job="placed") if e.action == "sink.fenced"]
    assert [(e.details["run"], e.details["batch"]) for e in refused] == [(run_id, 2)]
    assert sink.written_by(context)
    assert not sink.written_by(WriteContext(server.url, "placed", "events", successor))


def test_a_batch_id_the_log_has_is_skipped_only_when_planned_from_the_same_offsets(
        server: Server, spark: Any, tmp_path: Path) -> None:
    """Skipping a logged batch id is right for a replay (the same source offsets) and loses rows otherwise (a run
    that planned that id from other offsets): then the write fails, naming both and the way on."""
    first = current_run(server.url, "replayed", spark.version)
    out = tmp_path / "out"
    sink = Files(str(out))

    def context(run: int, log_offset: int) -> WriteContext:
        checkpoint = tmp_path / f"checkpoint-{run}-{log_offset}"
        (checkpoint / "offsets").mkdir(parents=True)
        (checkpoint / "offsets" / "0").write_text(f'v1\n{{"batchWatermarkMs":0}}\n{{"logOffset":{log_offset}}}')
        return WriteContext(server.url, "replayed", "events", run, str(checkpoint))

    rows = spark.createDataFrame([("a",)], "key string")
    assert sink.write(rows, 0, context(first, 3))
    second = current_run(server.url, "replayed", spark.version)
    assert not sink.write(rows, 0, context(second, 3))  # a replay: the same offsets, skipped
    with pytest.raises(ChangeoverError, match=r"replay of batch 0 .* by run \d+ .*from run \d+, planned from other "
                                              r'source offsets \(\{"logOffset":3\}, not \{"logOffset":4\}\).*'
                                              r"--rewind-sink"):
        sink.write(rows, 0, context(second, 4))
    assert _read(spark, out) == ["a"]


def test_a_registry_lost_inside_the_commit_is_noticed_before_the_log_entry(
        server: Server, spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry restarts after the batch's files are in place, which releases the row lock with the connection
    that held it. The commit confirms its lock before it adds the log entry, so the entry is added by the retry,
    under a lock taken again, and never while another run could have been made current."""
    from changeover import faults
    from changeover.registry import db
    from changeover.registry.db import lock_row
    from sqlalchemy.exc import OperationalError

    run_id = current_run(server.url, "restarted", spark.version)
    out = tmp_path / "out"
    sink, context = Files(str(out)), WriteContext(server.url, "restarted", "events", run_id)
    placed_points: list[str] = []

    def restart_once(name: str, detail: str = "") -> None:
        placed_points.append(name)
        if name == "files.placed" and placed_points.count(name) == 1:
            server.stop()
            server.start()

    add, added = files._add_to_log, []

    def add_noting_the_lock(*args: Any) -> None:
        monkeypatch.setattr(db, "LOCK_WAIT_SECONDS", 0.5)
        try:
            with session_scope(server.url) as s:
                db.bound_lock_waits(s)
                lock_row(s, Job, "restarted")
            locked = False
        except OperationalError as refused:
            locked = refused.orig.sqlstate == "55P03"  # another writer cannot take the job's row now
        monkeypatch.setattr(db, "LOCK_WAIT_SECONDS", 60.0)
        added.append((args[2], locked))
        add(*args)

    monkeypatch.setattr(faults, "reached_in_job", restart_once)
    monkeypatch.setattr(files, "_add_to_log", add_noting_the_lock)
    assert sink.write(spark.createDataFrame([("a",), ("b",)], "key string"), 0, context)
    assert placed_points.count("files.placed") == 2  # the first try's lock was lost; the retry placed nothing new
    assert added == [(0, True)]
    forget_engines()
    assert _read(spark, out) == ["a", "b"] and sink.progress(context) == 0


def test_a_driver_cut_off_from_the_registry_stands_down_and_resumes_when_confirmed(
        server: Server, spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past its bound without confirming that it is its job's current run, the driver stops its queries, the batch
    waiting inside its write for the registry included, so nothing of that run is left running when the control
    plane may record it lost; once the registry says it is still current, the queries start again and the batch
    lands once."""
    settings = Settings.from_env(home=tmp_path / "home", database_url=server.url)
    run_id = current_run(server.url, "cutoff", spark.version)
    landing, out = tmp_path / "landing", tmp_path / "out"
    staged, registry_down = threading.Event(), threading.Event()
    commit = Files._commit

    def commit_once_the_registry_is_down(self: Files, *args: Any) -> bool:
        if args[2] == 1 and not registry_down.is_set():  # batch 1: staged; its commit starts with the registry away
            staged.set()
            registry_down.wait(120)
        return commit(self, *args)

    monkeypatch.setattr(Files, "_commit", commit_once_the_registry_is_down)
    _land(landing, "0", ["a", "b"])
    sink = Files(str(out))
    stage = Stage("events", spark.readStream.schema("key string").json(str(landing)), sink, trigger="0.2 seconds")
    driver = Driver(settings, "cutoff", run_id, self_fence_seconds=3.0)
    with _running(server.url, driver, stage, tmp_path / "ckpt", spark):
        wait_for(lambda: _read(spark, out) == ["a", "b"], 120, "the first batch in the file sink")
        _land(landing, "1", ["c"])
        assert staged.wait(120), "the second batch was not staged"
        server.stop()
        registry_down.set()
        try:
            wait_for(lambda: not spark.streams.active, 60, "the driver stopping its queries, the waiting one included")
            assert _read(spark, out) == ["a", "b"]
            assert not list((out / files.STAGING).rglob("*.parquet"))  # the write gave up, and cleaned its staging
        finally:
            server.start()
        wait_for(lambda: _read(spark, out) == ["a", "b", "c"], 120, "the queries started again, the batch written")
        forget_engines()
        events = [e for e in audit.find(server.url, job="cutoff") if e.action == "job.self_fenced"]
        assert [(e.details["stages"], e.details["then"]) for e in events] == [(["events"], "resumed")]
    assert sink.progress(WriteContext(server.url, "cutoff", "events", run_id)) == 1  # two batches, each once
