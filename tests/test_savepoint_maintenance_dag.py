"""The savepoint_maintenance DAG through `airflow dags test`: savepoints, Asset events, retention, retries.

The job here is a registry row whose checkpoint folder has Spark's layout but was written by the
test, not by a Spark driver: a `continue` savepoint only reads the checkpoint and the registry, and
a real driver would add minutes without exercising anything more of this DAG.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from changeover import savepoints
from changeover.cli import local_airflow
from changeover.settings import Settings
from sqlalchemy import create_engine, text
from test_savepoint_refusals import _fake_committed_checkpoint, _job_with_checkpoint

pytestmark = pytest.mark.slow


def test_maintenance_takes_publishes_retains_and_a_rerun_does_not_duplicate(
    settings: Settings, tmp_path: Path, database_url: str, pg_database
) -> None:
    _fake_committed_checkpoint(tmp_path / "cp")
    _job_with_checkpoint(settings, tmp_path / "cp")
    savepoints.take(settings, "clicks", "older", mode="continue")
    airflow_db = (f"sqlite:///{tmp_path / 'airflow.db'}" if database_url.startswith("sqlite")
                  else pg_database("changeover_airflow"))
    env = local_airflow.airflow_env(settings, airflow_home=tmp_path / "airflow", sql_conn=airflow_db)
    local_airflow.migrate_airflow(env)

    log = tmp_path / "run1.log"
    assert local_airflow.dags_test("savepoint_maintenance", {"max_count": 1}, env, log) == 0, \
        log.read_text(errors="replace")[-4000:]
    taken = [sp["name"] for sp in savepoints.list_savepoints(settings, "clicks")]
    assert len(taken) == 1 and taken[0].startswith("scheduled-")  # max_count=1 removed "older"

    with create_engine(airflow_db).connect() as conn:
        extras = [json.loads(row[0]) if isinstance(row[0], str) else row[0]
                  for row in conn.execute(text("SELECT extra FROM asset_event"))]
    assert [(e["job"], e["savepoint"], e["mode"]) for e in extras] == [("clicks", taken[0], "continue")]

    # A retried savepoint task renders the same name and gets the same savepoint back.
    sp = savepoints.take(settings, "clicks", taken[0], mode="continue", exist_ok=True)
    assert sp.name == taken[0]
    assert len(savepoints.list_savepoints(settings, "clicks")) == 1
