"""A light job from the UI: SQL on the largest version group, through a member's Spark Connect server."""

from airflow.sdk import DAG, Param
from changeover_airflow.operators import LightJobOperator

with DAG(
    dag_id="light_sql",
    description="Run SQL as a light job, routed to the largest Spark version group",
    schedule=None,
    catchup=False,
    render_template_as_native_obj=True,
    params={
        "sql": Param("SELECT split(version(), ' ')[0] AS spark_version", type="string",
                     description="The SQL to run."),
        "block_shutdown": Param(True, type="boolean",
                                description="Hold a drain of its member until it ends (else interrupted after "
                                            "shutdown_timeout)."),
        "shutdown_timeout": Param(30, type="integer", minimum=0, description="Seconds a drain waits for it."),
    },
    tags=["changeover"],
):
    LightJobOperator(
        task_id="sql",
        sql="{{ params.sql }}",
        block_shutdown="{{ params.block_shutdown }}",
        shutdown_timeout="{{ params.shutdown_timeout }}",
        retries=0,  # not fault-tolerant: a statement that wrote and lost its answer must not run twice
    )
