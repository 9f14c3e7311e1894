"""Update a job's code: check (static + dry run) -> stop with a savepoint -> resume on the new code -> stability
gate; on a failure the old code resumes from the same savepoint. The summary says what happened. With
state_partitions the resume also repartitions the state (checked first); the rollback resumes the savepoint as it
was, with its own count. With the strategy zero_downtime nothing stops at `stop`: `resume` starts a follower on the
new code that replays the job's batches read-only and takes over at a batch boundary once it has caught up, where
the savepoint is taken."""

from datetime import timedelta

from airflow.sdk import DAG, Param
from changeover_airflow.approval import PlanApprovalOperator
from changeover_airflow.chains import APPROVAL_RETRIES, REQUIRE_APPROVAL
from changeover_airflow.operators import (
    CompatibilityCheckOperator,
    ResumeWithCodeOperator,
    RollbackJobOperator,
    StabilityGateOperator,
    UpdateStopOperator,
    UpdateSummaryOperator,
)

RUN = "{{ run_id | replace(':', '') | replace('+', '') }}"  # one run, one set of savepoint names, on every try
JOB, CODE, RENAMES = "{{ params.job }}", "{{ params.code }}", "{{ params.rename_stages }}"
PARTITIONS, STRATEGY = "{{ params.state_partitions }}", "{{ params.strategy }}"
CHOSEN = "{{ (ti.xcom_pull(task_ids='stop') or {}).get('strategy') or params.strategy }}"  # the stop task's choice

with DAG(
    dag_id="update_job",
    description="Ship new code to a running job without losing its state; roll back if it is not stable",
    schedule=None,
    max_active_runs=1,
    render_template_as_native_obj=True,
    default_args={"retries": 2, "retry_delay": timedelta(seconds=10)},
    params={
        "job": Param("clicks", type="string", minLength=1, description="The job to update."),
        "code": Param("", type="string", minLength=1,
                      description="Its new code: a .py file or package folder the workers can read, or a module."),
        "rename_stages": Param({}, type="object", description='Stage renames, {"old name": "new name"}.'),
        "allow_non_restored_state": Param(False, type="boolean",
                                          description="Drop state of stages the new code no longer has."),
        "dry_run": Param(True, type="boolean",
                         description="Replay a batch of each stage on a copy of the savepoint before the stop."),
        "strict": Param(False, type="boolean", description="Refuse stage names that look generated (stage_0)."),
        "stable_batches": Param(5, type="integer", minimum=1, description="Batches the new code must commit."),
        "max_lag_seconds": Param(60, type="number", minimum=1, description="Its last commit may be this old."),
        "gate_timeout_seconds": Param(300, type="number", minimum=10, description="Time the gate waits."),
        "require_approval": REQUIRE_APPROVAL,
        "state_partitions": Param(0, type="integer", minimum=0,
                                  description="Repartition the state to this many partitions on resume (RocksDB "
                                              "store, Spark 4.2+); 0 keeps each stage's count."),
        "strategy": Param("", enum=["", "stop", "zero_downtime"],
                          description="stop: stop with a savepoint, resume on the new code. zero_downtime: a "
                                      "follower on the new code catches up read-only, then takes over from the next "
                                      "batch. Empty: the job's option move_strategy (zero_downtime), else stop."),
        "catch_up_seconds": Param(300, type="integer", minimum=10,
                                  description="zero_downtime: how long the follower has to catch up before the "
                                              "update is abandoned (the job keeps running its old code)."),
    },
    tags=["changeover"],
):
    check = CompatibilityCheckOperator(
        task_id="check", job=JOB, code=CODE, savepoint_name=f"update-check-{RUN}", rename_stages=RENAMES,
        dry_run="{{ params.dry_run }}", strict="{{ params.strict }}",
        allow_non_restored_state="{{ params.allow_non_restored_state }}", state_partitions=PARTITIONS)
    approval = PlanApprovalOperator(task_id="approval", require_approval="{{ params.require_approval }}",
                                    subject="Approve the update of job {{ params.job }}?", plan_task_id="check",
                                    upgrade_step=False, **APPROVAL_RETRIES)
    stop = UpdateStopOperator(task_id="stop", job=JOB, savepoint_name=f"update-{RUN}", strategy=STRATEGY,
                              rename_stages=RENAMES, allow_non_restored_state="{{ params.allow_non_restored_state }}",
                              state_partitions=PARTITIONS)
    resume = ResumeWithCodeOperator(task_id="resume", job=JOB, savepoint_name=f"update-{RUN}",
                                    code="{{ ti.xcom_pull(task_ids='check', key='new_code') }}",  # as checked
                                    rename_stages=RENAMES,
                                    allow_non_restored_state="{{ params.allow_non_restored_state }}",
                                    state_partitions=PARTITIONS,
                                    strategy=CHOSEN,
                                    catch_up_seconds="{{ params.catch_up_seconds }}")
    gate = StabilityGateOperator(task_id="gate", job=JOB, savepoint_name=f"update-{RUN}", rename_stages=RENAMES,
                                 batches="{{ params.stable_batches }}", max_lag_seconds="{{ params.max_lag_seconds }}",
                                 gate_timeout="{{ params.gate_timeout_seconds }}")
    rollback = RollbackJobOperator(task_id="rollback", job=JOB, savepoint_name=f"update-{RUN}",
                                   trigger_rule="one_failed")
    summary = UpdateSummaryOperator(task_id="summary", job=JOB, savepoint_name=f"update-{RUN}",
                                    trigger_rule="all_done", retries=0)
    check >> approval >> stop >> resume >> gate >> rollback >> summary
