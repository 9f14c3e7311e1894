"""The task chain every upgrade DAG runs: preflight >> compatibility >> approval >> roll >> rebalance >> verify >>
finish."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from airflow.sdk import Param
from changeover.cluster.runtimes import SUPPORTED_VERSIONS, installed_versions
from changeover.settings import Settings

from changeover_airflow.approval import PlanApprovalOperator
from changeover_airflow.hooks import ChangeoverHook
from changeover_airflow.operators import (
    CompatibilityCheckOperator,
    FinishUpgradeOperator,
    PreflightOperator,
    RebalanceJobsOperator,
    RollingUpgradeOperator,
    VerifyUpgradeOperator,
)

# Every task picks up where the last try was, so retries are cheap; enough of them to outlast spurious
# retries from the scheduler's deferral race.
UPGRADE_DEFAULT_ARGS: dict[str, Any] = {"retries": 6, "retry_delay": timedelta(seconds=10)}
# Airflow 3.3 can fail an approval answered within seconds of asking (the asking try's late exit report overrides
# the resumed state, as in its deferral race): the retry takes that answer (PlanApprovalOperator) rather than the run
# failing.
APPROVAL_RETRIES: dict[str, Any] = {"retries": 2, "retry_delay": timedelta(seconds=5)}


REQUIRE_APPROVAL = Param(False, type="boolean", description="Before anything is drained or stopped, show the plan in "
                         "Required Actions and wait for a person to approve it; a rejection ends the run.")


def upgrade_params(target_description: str, **extra: Param) -> dict[str, Param]:
    """The trigger form's fields every upgrade DAG shares: the installed versions, the drain timeout, dry run."""
    versions = installed_versions(Settings.from_env().runtimes_dir) or list(SUPPORTED_VERSIONS)
    return {
        "target_version": Param(versions[-1], enum=versions, description=target_description),
        **extra,
        "shutdown_timeout": Param(30, type="integer", minimum=0,
                                  description="Default seconds a drain waits for a job without blockShutdown."),
        "surge": Param(0, type="integer", minimum=0, maximum=3,
                       description="Temporary members at the target version for the length of the upgrade, so "
                                   "capacity does not drop while each member drains (removed at the end)."),
        "move_strategy": Param("warm", enum=["warm", "zero_downtime"],
                               description="How each job moves. warm: its successor starts before the job stops, "
                                           "and the job is down from its stop to the successor's first batch. "
                                           "zero_downtime: the successor also replays the job's batches read-only "
                                           "until it has caught up, then takes over from the next batch."),
        "catch_up_seconds": Param(300, type="integer", minimum=10,
                                  description="zero_downtime: how long a successor has to catch up before its move "
                                              "is aborted (the job keeps running where it is)."),
        "dry_run": Param(False, type="boolean", description="Only check and print the plan."),
        "require_approval": REQUIRE_APPROVAL,
        "connection": Param(ChangeoverHook.default_conn_name, type="string", minLength=1,
                            description="The Changeover connection of the cluster and registry to upgrade (its "
                                        "extras name them: a team with several clusters has one each)."),
        "replay_check": Param(True, type="boolean", description="Before any drain, replay a batch of every "
                              "running job on the target version from a copy of its state (the static check "
                              "always runs; the replay also catches what only Spark can see)."),
    }


def upgrade_chain(
    *,
    members: Any = None,
    marked_only: bool = False,
    window: str | None = None,
    drain_needs_seconds: Any = 0,
) -> list[Any]:
    """Build the chain inside a DAG. Templates read the DAG's `target_version` and `shutdown_timeout` Params."""
    target, conn = "{{ params.target_version }}", {"changeover_conn_id": "{{ params.connection }}"}
    tasks = [
        PreflightOperator(task_id="preflight", target_version=target, members=members, marked_only=marked_only,
                          **conn),
        # every running fault-tolerant job replays a batch on the target runtime before any member is drained
        CompatibilityCheckOperator(task_id="compatibility", target_version=target, upgrade_step=True,
                                   dry_run="{{ params.replay_check }}",
                                   savepoint_name="upgrade-check-{{ run_id | replace(':', '') | replace('+', '') }}",
                                   **conn),
        PlanApprovalOperator(task_id="approval", require_approval="{{ params.require_approval }}", upgrade_step=True,
                             subject="Approve the rolling upgrade to Spark {{ params.target_version }}?",
                             plan_task_id="preflight", **APPROVAL_RETRIES, **conn),
        RollingUpgradeOperator(task_id="roll", shutdown_timeout="{{ params.shutdown_timeout }}", window=window,
                               drain_needs_seconds=drain_needs_seconds, surge="{{ params.surge }}",
                               move_strategy="{{ params.move_strategy }}",
                               catch_up_seconds="{{ params.catch_up_seconds }}", **conn),
        RebalanceJobsOperator(task_id="rebalance", **conn),
        VerifyUpgradeOperator(task_id="verify", target_version=target, **conn),
        # all_done: whatever failed upstream, an upgrade not verified by now ends FAILED and frees the lock
        FinishUpgradeOperator(task_id="finish", trigger_rule="all_done", retries=0, **conn),
    ]
    for before, after in zip(tasks, tasks[1:], strict=False):
        before >> after
    return tasks
