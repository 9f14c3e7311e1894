"""One real Airflow (`airflow standalone`: scheduler, LocalExecutor, triggerer, api-server) per metadata
database, shared by the end-to-end tests of that database, with the registry of the same kind.

Each test brings up its own Spark members and jobs and stops them afterwards; Airflow and the
registry outlive the test, as they would in production.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from changeover import jobs
from changeover.cli import local_airflow
from changeover.cluster import LocalCluster
from changeover.errors import ChangeoverError
from changeover.registry.db import forget_engines
from changeover.registry.schema import migrate
from changeover.settings import CHECKOUT, Settings
from conftest import PG_ADMIN_URL
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

ARTIFACTS = CHECKOUT / "test-artifacts"


@dataclass
class Stack:
    kind: str
    settings: Settings
    airflow: local_airflow.Standalone
    cluster: LocalCluster

    def artifacts(self, name: str) -> Path:
        folder = ARTIFACTS / f"{name}-{self.kind}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        return folder


def _dags_folder(folder: Path) -> Path:
    """The project's DAGs plus the tests' own (the deferral race reproduction)."""
    folder.mkdir(parents=True, exist_ok=True)
    for dag in [*(CHECKOUT / "dags").glob("*.py"), *(Path(__file__).parent / "dags").glob("*.py")]:
        (folder / dag.name).symlink_to(dag)
    return folder


REGISTRY_ROLE, REGISTRY_PASSWORD = "changeover_app", f"pw-{secrets.token_hex(8)}"


def _with_password(url: str) -> str:
    """The registry as a role with a password, as in production; the server's trust auth does not check it,
    but every process is handed it, so the tests can look for it where it must never be."""
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        if not conn.scalar(text("SELECT 1 FROM pg_roles WHERE rolname = :r"), {"r": REGISTRY_ROLE}):
            conn.execute(text(f"CREATE ROLE {REGISTRY_ROLE} LOGIN"))
        conn.execute(text(f"ALTER ROLE {REGISTRY_ROLE} PASSWORD '{REGISTRY_PASSWORD}'"))
        conn.execute(text(f'ALTER DATABASE "{make_url(url).database}" OWNER TO {REGISTRY_ROLE}'))
    admin.dispose()
    return make_url(url).set(username=REGISTRY_ROLE, password=REGISTRY_PASSWORD).render_as_string(
        hide_password=False)


def _stack(kind: str, root: Path, pg_database) -> Iterator[Stack]:  # type: ignore[no-untyped-def]
    if kind == "postgresql" and not PG_ADMIN_URL:
        pytest.skip("set CHANGEOVER_TEST_DATABASE_URL to run this against PostgreSQL (CI does)")
    registry = (f"sqlite:///{root / 'registry.db'}" if kind == "sqlite"
                else _with_password(pg_database("changeover_e2e")))
    metadata = f"sqlite:///{root / 'airflow.db'}" if kind == "sqlite" else pg_database("changeover_e2e_airflow")
    settings = Settings.from_env(home=root / "home", database_url=registry)
    migrate(registry)
    env = local_airflow.airflow_env(settings, airflow_home=root / "airflow", sql_conn=metadata)
    env["AIRFLOW__CORE__DAGS_FOLDER"] = str(_dags_folder(root / "dags"))
    env["CHANGEOVER_FAULTS"] = "1"  # the tests' Airflow honours armed fault points; a user's never does
    # The DAG files do not change during the tests: parsed at the start, not again every 30 s (each parse costs the
    # dag-processor about a second of CPU, of the two cores the Spark jobs run on).
    env["AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL"] = "3600"
    (root / "airflow").mkdir(parents=True, exist_ok=True)
    local_airflow.migrate_airflow(env)
    airflow = local_airflow.Standalone(env, root / "airflow-standalone.log")
    cluster = LocalCluster(settings)
    try:
        airflow.start()
        yield Stack(kind, settings, airflow, cluster)
    finally:
        airflow.stop()
        cluster.down()
        forget_engines()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`only_on(kind, why)`: a case of one metadata database is skipped on the other before its fixtures start
    members for nothing."""
    for item in items:
        only = item.get_closest_marker("only_on")
        if only is None:
            continue
        kind = getattr(item, "callspec", None) and item.callspec.params.get("stack")
        if kind is None:
            raise pytest.UsageError(f"{item.nodeid}: only_on needs the `stack` fixture, whose kind it picks")
        if kind != only.args[0]:
            item.add_marker(pytest.mark.skip(reason=only.args[1]))


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, pg_database) -> Iterator[Stack]:
    yield from _stack(request.param, tmp_path_factory.mktemp(f"e2e-{request.param}"), pg_database)


@pytest.fixture
def members(stack: Stack) -> Iterator[list[str]]:
    """Three members at Spark 4.2.0, stopped after the test even when it fails."""
    names = ["m1", "m2", "m3"]
    try:
        stack.cluster.up([(m, "4.2.0") for m in names])
        yield names
    finally:
        _cancel_live_jobs(stack)
        stack.cluster.down()


def _cancel_live_jobs(stack: Stack) -> None:
    """A test's jobs end with it: a run left RUNNING in the registry would be checked, replayed and waited on
    by the next test's upgrade until its master's silence made it lost."""
    for job in jobs.list_jobs(stack.settings):
        if job["state"] in jobs.LIVE:
            with contextlib.suppress(ChangeoverError):
                jobs.cancel(stack.settings, stack.cluster, job["name"], reason="the test is over")
