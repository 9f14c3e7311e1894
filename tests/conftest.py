"""Fixtures: a registry on SQLite and, when CHANGEOVER_TEST_DATABASE_URL is set, on PostgreSQL too."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from changeover.cluster import LocalCluster
from changeover.registry.db import forget_engines
from changeover.registry.schema import migrate
from changeover.settings import Settings
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

PG_ADMIN_URL = os.environ.get("CHANGEOVER_TEST_DATABASE_URL")
# Every JVM the tests start (masters, workers, drivers, executors, local sessions, Airflow's tasks' Spark) compiles
# with C1 only and collects with the serial collector: on 2 cores a launch's first commit takes about 17 s instead
# of 24 s, and 30 s instead of 54 s beside a running job. What the tests assert does not depend on the JIT tier;
# the benchmarks under bench/ run with Spark's defaults.
os.environ.setdefault("JAVA_TOOL_OPTIONS", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
# Modules whose subject is Spark (savepoints, user jobs on a live cluster) run on one registry: PostgreSQL
# when CI sets it. The registry's own behaviour is covered on both kinds by the registry tests and by the
# Airflow end-to-end runs, and one cluster per module instead of two keeps `make test` inside its hour.
ONE_REGISTRY = ["postgresql" if PG_ADMIN_URL else "sqlite"]
# The trigger of the tests' running jobs (the demo's own default is 1 s). A batch of the demo's job costs most of a
# core-second on these machines, whatever its input: one job at 1 s keeps 79% of two cores busy, at 2 s 42% (3 s:
# 29%), and the launches, savepoints and Airflow tasks a test waits on share what is left. What the tests assert
# holds at any interval; the freshness bounds name their own.
TRIGGER = "2 seconds"


@pytest.fixture(scope="session")
def pg_database() -> Iterator[callable]:
    """Creates throwaway PostgreSQL databases and drops them at the end of the session."""
    created: list[str] = []
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT") if PG_ADMIN_URL else None

    def make(prefix: str) -> str:
        assert admin is not None
        name = f"{prefix}_{uuid.uuid4().hex[:10]}"
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        created.append(name)
        return make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)

    yield make
    forget_engines()
    if admin is not None:
        with admin.connect() as conn:
            for name in created:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def registry_settings(kind: str, home: Path, pg_database: callable, prefix: str) -> Settings:
    """A migrated registry of the kind (skipped for PostgreSQL unless CI's variable is set), for a module's cluster."""
    if kind == "postgresql" and not PG_ADMIN_URL:
        pytest.skip("set CHANGEOVER_TEST_DATABASE_URL to run this against PostgreSQL (CI does)")
    url = f"sqlite:///{home / 'registry.db'}" if kind == "sqlite" else pg_database(prefix)
    migrate(url)
    return Settings.from_env(home=home / "home", database_url=url)


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path, pg_database: callable) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'registry.db'}"
    if not PG_ADMIN_URL:
        pytest.skip("set CHANGEOVER_TEST_DATABASE_URL to run this against PostgreSQL (CI does)")
    return pg_database("changeover_test")


@pytest.fixture
def settings(tmp_path: Path, database_url: str) -> Settings:
    settings = Settings.from_env(home=tmp_path / "home", database_url=database_url)
    migrate(database_url)
    return settings


@pytest.fixture
def cluster(settings: Settings) -> Iterator[LocalCluster]:
    """A local cluster whose processes are stopped after the test, also when it fails."""
    local = LocalCluster(settings)
    try:
        yield local
    finally:
        local.down()


@pytest.fixture(scope="module")
def local_spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A local Spark session in the test's process (local[2]) whose Python workers can import Changeover, as a
    runtime's executors can: for sinks and driver loops tested on real DataFrames without a cluster."""
    from changeover.cluster import shipping
    from pyspark.sql import SparkSession

    package, _entry = shipping.runtime_artifacts(Settings.from_env(home=tmp_path_factory.mktemp("artifacts")))
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable  # executors need the registry's drivers, as a runtime has
    session = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
               .config("spark.sql.shuffle.partitions", "3").config("spark.submit.pyFiles", str(package))
               .getOrCreate())
    yield session
    for query in session.streams.active:
        query.stop()
    session.stop()


def current_run(url: str, job: str, version: str = "4.2.0") -> int:
    """A new RUNNING run made its job's current one (the job made first where missing): its id."""
    from changeover.registry.db import session_scope
    from changeover.registry.models import Job, JobRun

    with session_scope(url) as s:
        if s.get(Job, job) is None:
            s.add(Job(name=job, module="m", fault_tolerant=True, block_shutdown=False, options={}))
            s.flush()
        run = JobRun(job=job, spark_version=version, master_url="spark://x", state="RUNNING", progress={})
        s.add(run)
        s.flush()
        s.get(Job, job).make_current(run)
        return run.id


def drivers_of(job: str, run_id: int | None = None) -> list[psutil.Process]:
    """The Python driver processes of a job (of one run of it, where given) running on this machine."""
    wanted = f"--job {job} " + (f"--run-id {run_id} " if run_id is not None else "")
    return [p for p in psutil.process_iter(["name", "cmdline"]) if p.info["name"].startswith("python")
            and wanted in " ".join(p.info["cmdline"] or [])]


def feeding(landing: Any) -> Any:
    """The demo's generator writing into `landing`: a first file now, then one every 0.5 s in the background."""
    from changeover.cli.generator import Generator

    generator = Generator(landing)
    generator.write_file()
    generator.start(interval=0.5)
    return generator


def start_clicks(settings: Settings, cluster: Any, name: str, lease_seconds: float = 60) -> Any:
    """The demo's `clicks` job on the cluster, fed by a generator writing a file every 0.5 s, once it has committed
    its first batch. Returns the generator (its truth is what the job must end with)."""
    from changeover import jobs

    generator = feeding(settings.data_dir / f"landing-{name}")
    jobs.submit(settings, cluster, "jobs.clicks", name,
                options={"landing": str(generator.landing), "lease_seconds": lease_seconds, "trigger": TRIGGER})
    jobs.wait_until_committed(settings, cluster, name)
    return generator
