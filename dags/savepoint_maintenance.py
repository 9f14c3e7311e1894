"""Periodic `continue` savepoints of every fault-tolerant job, then retention and reconcile."""

from datetime import timedelta

from airflow.sdk import DAG, Param, task
from changeover_airflow.hooks import ChangeoverHook
from changeover_airflow.operators import SAVEPOINTS_ASSET, SavepointMaintenanceOperator, SavepointOperator

with DAG(
    dag_id="savepoint_maintenance",
    description="Savepoints of every fault-tolerant job without stopping it; retention; reconcile",
    schedule=timedelta(hours=1),
    catchup=False,
    max_active_runs=1,
    render_template_as_native_obj=True,
    default_args={"retries": 2, "retry_delay": timedelta(seconds=30)},
    params={
        "max_count": Param(24, type="integer", minimum=1, description="Savepoints kept per job."),
        "max_age_hours": Param(168, type="number", minimum=0, description="Older savepoints are deleted."),
    },
    tags=["changeover"],
):

    @task
    def fault_tolerant_jobs() -> list[str]:
        from changeover.jobs import fault_tolerant_jobs

        return fault_tolerant_jobs(ChangeoverHook().get_settings())

    saved = SavepointOperator.partial(
        task_id="savepoint",
        mode="continue",
        outlets=[SAVEPOINTS_ASSET],  # mapped tasks declare their outlets here, not in __init__
        savepoint_name="scheduled-{{ dag_run.run_after.strftime('%Y%m%dT%H%M%S') }}",
    ).expand(job=fault_tolerant_jobs())
    saved >> SavepointMaintenanceOperator(
        task_id="retention_and_reconcile",
        max_count="{{ params.max_count }}",
        max_age_hours="{{ params.max_age_hours }}",
        trigger_rule="all_done",
    )
