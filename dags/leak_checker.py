"""The leak checker: what the registry and Spark disagree on, and what crashed work left, cleaned after a grace."""

from datetime import timedelta

from airflow.sdk import DAG, Param
from changeover_airflow.leak_check import LeakCheckOperator

with DAG(
    dag_id="leak_checker",
    description="Runs, light jobs, drivers, PID files and staging folders nobody accounts for; cleaned after a grace",
    schedule=timedelta(minutes=15),
    catchup=False,
    max_active_runs=1,
    render_template_as_native_obj=True,
    params={
        "grace_seconds": Param(600, type="integer", minimum=0,
                               description="A leak is only reported until it has been seen this long."),
    },
    tags=["changeover"],
):
    # no retries: the next run, 15 minutes on, looks again
    LeakCheckOperator(task_id="check", grace_seconds="{{ params.grace_seconds }}")
