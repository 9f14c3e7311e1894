"""Rolling Spark upgrade: preflight -> per member (drain, upgrade), one at a time -> rebalance -> verify."""

from datetime import timedelta

from airflow.sdk import DAG, Param
from changeover.runtimes import SUPPORTED_VERSIONS, installed_versions
from changeover.settings import Settings
from changeover_airflow.operators import (
    PreflightOperator,
    RebalanceJobsOperator,
    RollMemberOperator,
    VerifyUpgradeOperator,
)

VERSIONS = installed_versions(Settings.from_env().runtimes_dir) or list(SUPPORTED_VERSIONS)

with DAG(
    dag_id="rolling_upgrade",
    description="Roll every member to a new Spark version without losing streaming state",
    schedule=None,
    max_active_runs=1,
    render_template_as_native_obj=True,
    default_args={"retries": 2, "retry_delay": timedelta(seconds=10)},
    params={
        "target_version": Param(VERSIONS[-1], enum=VERSIONS, description="Spark version to roll every member to."),
        "members": Param([], type="array", items={"type": "string"},
                         description="Members to upgrade, in order. Empty means every member."),
        "shutdown_timeout": Param(30, type="integer", minimum=0,
                                  description="Default seconds a drain waits for a job without blockShutdown."),
        "dry_run": Param(False, type="boolean", description="Only check and print the plan."),
    },
    tags=["changeover"],
):
    preflight = PreflightOperator(
        task_id="preflight", target_version="{{ params.target_version }}", members="{{ params.members }}"
    )

    roll = RollMemberOperator.partial(
        task_id="drain_and_upgrade", target_version="{{ params.target_version }}", max_active_tis_per_dagrun=1
    ).expand(member=preflight.output)
    rebalance = RebalanceJobsOperator(task_id="rebalance")
    verify = VerifyUpgradeOperator(task_id="verify", target_version="{{ params.target_version }}")
    roll >> rebalance >> verify
