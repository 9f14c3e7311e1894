"""A driver that cannot confirm it is its job's current run fences itself: past its bound (half the loss deadline),
the queries of sinks nothing fences stop, so nothing more reaches them before the control plane may declare the run
lost and let a successor write; they start again once the registry says the run is still current.

The driver's loop runs here in the test's process on a local Spark session, against a PostgreSQL registry of the
test's own, which is stopped and started again for the outage (a worker-hosted driver is the same code).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from changeover import audit
from changeover.cluster import wait_for
from changeover.registry.db import forget_engines, session_scope
from changeover.registry.models import Job, JobRun
from changeover.registry.schema import migrate
from changeover.runtime.contract import Stage
from changeover.runtime.driver import Driver
from changeover.runtime.sinks import Files
from changeover.settings import Settings
from pg_server import Server, own_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with own_server() as started:
        yield started


@pytest.fixture(scope="module")
def spark(local_spark: Any) -> Any:
    return local_spark


def test_a_driver_cut_off_from_the_registry_stops_its_file_sink_and_resumes_when_confirmed(
        server: Server, spark: Any, tmp_path: Path) -> None:
    migrate(server.url)
    settings = Settings.from_env(home=tmp_path / "home", database_url=server.url)
    with session_scope(server.url) as s:
        s.add(Job(name="cutoff", module="m", fault_tolerant=True, block_shutdown=False, options={}))
        s.flush()
        run = JobRun(job="cutoff", spark_version=spark.version, master_url="local", state="RUNNING", progress={})
        s.add(run)
        s.flush()
        s.get(Job, "cutoff").make_current(run)
        run_id = run.id
    landing, out = tmp_path / "landing", tmp_path / "out"
    landing.mkdir()

    def land(name: str, keys: list[str]) -> None:
        (landing / f"{name}.json").write_text("".join(f'{{"key": "{k}"}}\n' for k in keys))

    def rows_written() -> int:
        return spark.read.schema("key string").parquet(str(out)).count() if out.is_dir() else 0

    land("0", ["a", "b"])
    frame = spark.readStream.schema("key string").json(str(landing))
    stage = Stage("events", frame, Files(str(out)), trigger="0.2 seconds")
    driver = Driver(settings, "cutoff", run_id, self_fence_seconds=3.0)
    outcome: list[Any] = []
    loop = threading.Thread(target=lambda: outcome.append(driver.run_streaming([stage], tmp_path / "ckpt",
                                                                               spark=spark)), daemon=True)
    loop.start()
    try:
        wait_for(lambda: rows_written() == 2, 120, "the first batch in the file sink")
        server.stop()
        try:
            wait_for(lambda: not spark.streams.active, 60, "the driver stopping its file sink's query")
            land("1", ["c"])  # arrives while the run cannot confirm it owns the job: its query is stopped
            assert rows_written() == 2
        finally:
            server.start()
        wait_for(lambda: rows_written() == 3, 120, "the query started again, and its next batch written")
        forget_engines()
        events = [e for e in audit.find(server.url, job="cutoff") if e.action == "job.self_fenced"]
        assert [(e.details["stages"], e.details["then"]) for e in events] == [(["events"], "resumed")]
        with session_scope(server.url) as s:
            s.get(Job, "cutoff").desired = "STOP"
        loop.join(120)
        assert outcome == [True]
    finally:
        if loop.is_alive():
            with session_scope(server.url) as s:
                s.get(Job, "cutoff").current_run_id = None  # fenced: the loop stops its queries and returns
            loop.join(60)
