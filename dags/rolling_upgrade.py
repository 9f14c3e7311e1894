"""Rolling Spark upgrade: preflight -> roll (each member drained, then upgraded, in order) -> rebalance -> verify."""

from airflow.sdk import DAG, Param
from changeover_airflow.chains import UPGRADE_DEFAULT_ARGS, upgrade_chain, upgrade_params

with DAG(
    dag_id="rolling_upgrade",
    description="Roll every member to a new Spark version without losing streaming state",
    schedule=None,
    max_active_runs=1,
    render_template_as_native_obj=True,
    default_args=UPGRADE_DEFAULT_ARGS,
    params=upgrade_params(
        "Spark version to roll every member to.",
        members=Param([], type="array", items={"type": "string"},
                      description="Members to upgrade, in order. Empty means every member."),
    ),
    tags=["changeover"],
):
    upgrade_chain(members="{{ params.members }}")
