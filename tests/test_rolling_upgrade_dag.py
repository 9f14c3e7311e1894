"""The rolling_upgrade DAG through real Airflow (`airflow dags test`) on a real local Spark cluster."""

from __future__ import annotations

from pathlib import Path

import pytest
from changeover import jobs, local_airflow, savepoints, sink
from changeover.cluster import LocalCluster, wait_for
from changeover.generator import Generator
from changeover.registry.db import session_scope
from changeover.registry.models import Event
from changeover.settings import Settings
from sqlalchemy import select

pytestmark = pytest.mark.slow


def test_rolling_upgrade_moves_a_live_stateful_job_without_losing_a_row(
    settings: Settings, cluster: LocalCluster, tmp_path: Path, database_url: str, pg_database
) -> None:
    cluster.up([("m1", "4.2.0"), ("m2", "4.2.0")])
    generator = Generator(settings.data_dir / "landing")
    generator.write_file()
    generator.start(interval=0.5)
    try:
        jobs.submit(settings, cluster, "jobs.clicks", "clicks", options={"landing": str(generator.landing)})
        jobs.wait_until_committed(settings, cluster, "clicks")
        # Airflow's own metadata lives in the same kind of database as the registry.
        airflow_db = (f"sqlite:///{tmp_path / 'airflow.db'}" if database_url.startswith("sqlite")
                      else pg_database("changeover_airflow"))
        env = local_airflow.airflow_env(settings, airflow_home=tmp_path / "airflow", sql_conn=airflow_db)
        local_airflow.migrate_airflow(env)
        log = tmp_path / "dags-test.log"
        code = local_airflow.dags_test("rolling_upgrade", {"target_version": "4.3.0"}, env, log)
        assert code == 0, log.read_text(errors="replace")[-5000:]
    finally:
        generator.stop()

    status = cluster.status()
    assert {(m["name"], m["version"], m["status"]) for m in status["members"]} == {
        ("m1", "4.3.0", "ACTIVE"), ("m2", "4.3.0", "ACTIVE")}
    assert [m["version"] for m in status["masters"] if m["running"]] == ["4.3.0"]
    taken = savepoints.list_savepoints(settings, "clicks")
    assert taken and all(sp["spark_version"] == "4.2.0" for sp in taken)
    run = jobs.refresh(settings, cluster, "clicks")
    assert run is not None and run.spark_version == "4.3.0" and run.state in jobs.LIVE

    wait_for(lambda: sink.results(settings.database_url, "clicks", "totals") == dict(generator.truth), 300,
             "the resumed job catching up with every generated file")
    with session_scope(settings.database_url) as s:
        actors = {e.actor.split("/")[0] for e in s.scalars(select(Event).where(Event.action == "drain.begin"))}
    assert actors == {"airflow:rolling_upgrade"}
