"""Run Airflow in-process from this checkout: AIRFLOW_HOME inside it, examples off, our DAGs and plugins.

Only builds environments and command lines; the core never imports Airflow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from changeover.settings import CHECKOUT, Settings

AIRFLOW = Path(sys.executable).parent / "airflow"


def airflow_env(settings: Settings, airflow_home: Path | None = None, sql_conn: str | None = None) -> dict[str, str]:
    home = airflow_home or Path(os.environ.get("AIRFLOW_HOME") or CHECKOUT / ".airflow")
    env = dict(os.environ)
    env.update(settings.as_env())
    env.update({
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(CHECKOUT / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(CHECKOUT / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__PARALLELISM": "4",
        "AIRFLOW__API__HOST": "127.0.0.1",
        "PYTHONPATH": os.pathsep.join([str(CHECKOUT / "plugins"), str(CHECKOUT / "include")]),
        "AIRFLOW_CONN_CHANGEOVER_DEFAULT": json.dumps({
            "conn_type": "changeover",
            "extra": {"home": str(settings.home), "database_url": settings.database_url},
        }),
    })
    if sql_conn:
        env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = sql_conn
    return env


def migrate_airflow(env: dict[str, str]) -> None:
    result = subprocess.run([str(AIRFLOW), "db", "migrate"], env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"airflow db migrate failed:\n{(result.stdout + result.stderr)[-4000:]}")


def dags_test(dag_id: str, conf: dict[str, Any], env: dict[str, str], log: Path) -> int:
    """`airflow dags test`: runs every task and trigger in this process tree, no scheduler needed."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        return subprocess.run(
            [str(AIRFLOW), "dags", "test", dag_id, "-c", json.dumps(conf)], env=env, stdout=out,
            stderr=subprocess.STDOUT,
        ).returncode
