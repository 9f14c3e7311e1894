"""The code update's operators (the update_job DAG): the compatibility check (also a version upgrade's step), the
stop, the resume on new code, the stability gate, the rollback and the summary."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from typing import Any

from changeover import jobs, savepoints
from changeover.errors import ChangeoverError
from changeover.jobs import move_history
from changeover.settings import Settings
from changeover.upgrade import code_update
from changeover.upgrade.zero_downtime import CatchUp, CatchUpTimedOut

from changeover_airflow.operators.base import ChangeoverOperator, _bool
from changeover_airflow.operators.savepoints import SAVEPOINTS_TAKEN, SavepointOperator, _publish


def _rendered(report: dict[str, Any]) -> list[str]:
    """A check report's lines, from its XCom form."""
    lines = [f"job {report['job']} against savepoint {report['savepoint']}: {report['verdict']}"]
    return lines + [f"  [{f['verdict']}] {f['rule']} stage {f['stage']}: {f['title']}: {f['detail']}"
                    for f in report["findings"]]


def _partitions(value: Any) -> int | None:
    """A templated count of state partitions: 0, empty or None keeps each stage's own."""
    return int(value) if value not in (None, "", "None") and int(value) > 0 else None


class CompatibilityCheckOperator(ChangeoverOperator):
    """Checks jobs against a fresh `continue` savepoint before anything running is touched: the static check,
    and with `dry_run` a batch of each stage replayed on the target runtime from scratch copies.

    `job` None checks every live fault-tolerant job on its own code (a version upgrade's preflight); with `code`
    it checks that job's new code. The reports go to XCom (key `reports`, and `old_code` for a code update); a
    job that would break fails the task, with the whole report in its log, and is not retried.
    """

    template_fields: Sequence[str] = ("changeover_conn_id", "job", "code", "target_version", "savepoint_name",
                                      "rename_stages", "dry_run",
                                      "strict", "allow_non_restored_state", "state_partitions")

    def __init__(self, *, savepoint_name: str, job: str | None = None, code: str | None = None,
                 target_version: str | None = None, rename_stages: Any = None, dry_run: Any = True,
                 strict: Any = False, allow_non_restored_state: Any = False, upgrade_step: bool = False,
                 state_partitions: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.state_partitions = state_partitions
        self.job, self.code, self.target_version = job, code, target_version
        self.savepoint_name = savepoint_name
        self.rename_stages = rename_stages
        self.dry_run, self.strict, self.allow_non_restored_state = dry_run, strict, allow_non_restored_state
        self.upgrade_step = upgrade_step

    def execute(self, context: Any) -> dict[str, Any]:
        from airflow.sdk.exceptions import AirflowFailException

        settings, cluster = self._setup(context)
        job = str(self.job) if self.job else None
        if job and self.code:  # a code update: what to roll back to, and the new code shipped once, as checked
            context["ti"].xcom_push(key="old_code", value=code_update.current_code(settings, job))
            context["ti"].xcom_push(key="new_code", value=code_update.ship(settings, job, str(self.code)))
        reports: dict[str, Any] = {}
        refused: list[str] = []
        for name in [job] if job else jobs.fault_tolerant_jobs(settings):
            if job is None and (reason := code_update.not_checkable(settings, cluster, name)):
                self.log.info("job %s is not checked: %s", name, reason)  # an upgrade moves only running state
                continue
            report = code_update.check(settings, name, str(self.code) if self.code else None, self.savepoint_name,
                                  self.rename_stages or {}, dry_run=_bool(self.dry_run), strict=_bool(self.strict),
                                  target_version=self.target_version or None,
                                  state_partitions=_partitions(self.state_partitions))
            passed = report.passes(_bool(self.allow_non_restored_state))
            for line in report.render().splitlines():
                (self.log.info if passed else self.log.error)("%s", line)
            reports[name] = report.as_dict()
            if not passed:
                refused.append(report.render())
        context["ti"].xcom_push(key="reports", value=reports)
        context["ti"].xcom_push(key="refused", value=bool(refused))
        if job and self.code:  # what an approver of the update is shown
            plan = [line for report in reports.values() for line in _rendered(report)]
            partitions = _partitions(self.state_partitions)
            plan += [f"then: stop job {job} at a batch boundary with a savepoint, resume it on {self.code}"
                     + (f" with its state in {partitions} partitions" if partitions else "")
                     + ", wait for the stability gate, and roll back to the savepoint on failure"]
            context["ti"].xcom_push(key="plan", value=plan)
        if refused:
            raise AirflowFailException("the change would break these jobs; nothing was stopped:\n" + "\n".join(refused))
        return reports


def _update_strategy(settings: Settings, job: str, asked: Any) -> str:
    """An update's strategy: the Param's, else the job's option (`code_update.strategy_of`)."""
    return code_update.strategy_of(str(asked) if asked else None, jobs.options_of(settings, job))


class UpdateStopOperator(SavepointOperator):
    """An update's stop with a savepoint; with the strategy zero_downtime the job is not stopped here (the resume
    task's follower takes it over at a batch boundary), and an update that cannot go zero-downtime is refused
    before anything is touched."""

    template_fields: Sequence[str] = (*SavepointOperator.template_fields, "strategy", "rename_stages",
                                      "allow_non_restored_state", "state_partitions")

    def __init__(self, *, strategy: Any = None, rename_stages: Any = None, allow_non_restored_state: Any = False,
                 state_partitions: Any = None, **kwargs: Any) -> None:
        kwargs.setdefault("outlets", [SAVEPOINTS_TAKEN])
        super().__init__(mode="stop", **kwargs)
        self.strategy, self.rename_stages = strategy, rename_stages
        self.allow_non_restored_state, self.state_partitions = allow_non_restored_state, state_partitions

    def execute(self, context: Any, event: dict[str, Any] | None = None,
                deadline: float | None = None) -> dict[str, Any]:
        settings, _ = self._setup(context)
        if _update_strategy(settings, self.job, self.strategy) != "zero_downtime":
            return {**super().execute(context, event, deadline), "strategy": "stop"}
        code_update.require_followable(self.job, self.rename_stages, _bool(self.allow_non_restored_state),
                                       _partitions(self.state_partitions))
        self.log.info("zero_downtime: job %s is not stopped; the resume task's follower takes it over at a batch "
                      "boundary, and savepoint %s is taken there", self.job, self.savepoint_name)
        return {"job": self.job, "savepoint": None, "strategy": "zero_downtime"}


class ResumeWithCodeOperator(ChangeoverOperator):
    """Resumes a stopped job from its savepoint on new code. A retry finds the run it launched and returns it.
    With the strategy zero_downtime the job was not stopped: a follower on the new code catches up with it
    read-only and takes over at a batch boundary, where the savepoint is taken (`code_update.cut_over`); the task
    waits in the triggerer between its steps."""

    template_fields: Sequence[str] = ("changeover_conn_id", "job", "code", "savepoint_name", "rename_stages",
                                      "allow_non_restored_state", "state_partitions", "strategy",
                                      "catch_up_seconds")

    def __init__(self, *, job: str, code: Any, savepoint_name: str, rename_stages: Any = None,
                 allow_non_restored_state: Any = False, state_partitions: Any = None, strategy: Any = None,
                 catch_up_seconds: Any = CatchUp.seconds, **kwargs: Any) -> None:
        kwargs.setdefault("outlets", [SAVEPOINTS_TAKEN])
        super().__init__(**kwargs)
        self.job, self.code, self.savepoint_name = job, code, savepoint_name
        self.rename_stages, self.allow_non_restored_state = rename_stages, allow_non_restored_state
        self.state_partitions, self.strategy, self.catch_up_seconds = state_partitions, strategy, catch_up_seconds

    def execute(self, context: Any, event: dict[str, Any] | None = None,
                deadline: float | None = None) -> dict[str, Any]:
        settings, cluster = self._setup(context)
        options = {"renames": self.rename_stages or {},
                   "allow_non_restored_state": _bool(self.allow_non_restored_state),
                   "state_partitions": _partitions(self.state_partitions)}
        if _update_strategy(settings, str(self.job), self.strategy) == "zero_downtime":
            catch_up = CatchUp(seconds=float(self.catch_up_seconds))
            try:
                run = code_update.cut_over(settings, cluster, str(self.job), self.code, self.savepoint_name,
                                           catch_up, **options)
            except CatchUpTimedOut as exc:  # a retry would wait as long again: the update fails, the job runs on
                from airflow.sdk.exceptions import AirflowFailException

                raise AirflowFailException(str(exc)) from exc
            if run is None:  # the job runs on while its follower starts or catches up
                self._defer("follow", str(self.job), settings, timeout=catch_up.seconds + 600, deadline=deadline,
                            params={"catch_up": asdict(catch_up)})
            try:
                _publish(context, self.outlets, savepoints.completed(settings, str(self.job), self.savepoint_name))
            except ChangeoverError as exc:  # the job runs the new code; the gate fails on the same missing savepoint
                self.log.warning("job %s was cut over to its new code, but its savepoint is not published: %s",
                                 self.job, exc)
        else:
            run = code_update.resume_with(settings, cluster, str(self.job), self.code, self.savepoint_name, **options)
        assert run is not None
        return {"job": self.job, "run": run.id, "spark_version": run.spark_version, "from": run.from_savepoint,
                "state_partitions": run.state_partitions}

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None,
                         deadline: float | None = None) -> dict[str, Any]:
        return self.execute(context, event, deadline)


class StabilityGateOperator(ChangeoverOperator):
    """Passes once the job's run has committed `batches` batches in every stage since its savepoint, without a
    failure, with its last commit younger than `max_lag_seconds`; fails, not retried, `gate_timeout` seconds after
    the launch of the run that `resume_task_id` started, whichever try of the task is running then (any other run,
    a rollback's say, is timed from the try's start). It waits in the triggerer, not in a worker slot."""

    template_fields: Sequence[str] = ("changeover_conn_id", "job", "savepoint_name", "batches", "max_lag_seconds",
                                      "gate_timeout", "rename_stages")

    def __init__(self, *, job: str, savepoint_name: str, batches: Any = 5, max_lag_seconds: Any = 60,
                 gate_timeout: Any = 300, rename_stages: Any = None, resume_task_id: str = "resume",
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.job, self.savepoint_name, self.resume_task_id = job, savepoint_name, resume_task_id
        self.batches, self.max_lag_seconds, self.gate_timeout = batches, max_lag_seconds, gate_timeout
        self.rename_stages = rename_stages

    def execute(self, context: Any, event: dict[str, Any] | None = None,
                deadline: float | None = None) -> dict[str, Any]:
        from airflow.sdk.exceptions import AirflowFailException

        settings, cluster = self._setup(context)
        result = code_update.stability(settings, cluster, str(self.job), self.savepoint_name, int(self.batches),
                                  float(self.max_lag_seconds), self.rename_stages or {})
        if deadline is None:  # a retry counts from the same launch as the first try: its deadline never starts again
            resumed = context["ti"].xcom_pull(task_ids=self.resume_task_id) or {}
            launched = result.launched_at if resumed.get("run") == result.run else None
            deadline = (launched or time.time()) + float(self.gate_timeout)
        if not (result.stable or result.ended or time.time() >= deadline):
            self._defer("stable", str(self.job), settings, timeout=float(self.gate_timeout) + 60,
                        fire_by=datetime.fromtimestamp(deadline, UTC), deadline=deadline,
                        params={"savepoint": self.savepoint_name, "batches": int(self.batches),
                                "max_lag_seconds": float(self.max_lag_seconds), "renames": self.rename_stages or {}})
        code_update.record_gate(settings, str(self.job), result)
        context["ti"].xcom_push(key="stability", value=result.__dict__)
        if not result.stable:
            raise AirflowFailException(f"job {self.job} is not stable on its new code: {result.reason}")
        self.log.info("job %s is stable: %s", self.job, result.reason)
        return result.__dict__

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None,
                         deadline: float | None = None) -> dict[str, Any]:
        return self.execute(context, event, deadline)


class RollbackJobOperator(ChangeoverOperator):
    """Runs when a step of the update failed: the old code again from the update's savepoint, its sinks rewound
    to that batch. A job still on its old code (the check or the stop failed) is left running as it is."""

    template_fields: Sequence[str] = ("changeover_conn_id", "job", "savepoint_name")

    def __init__(self, *, job: str, savepoint_name: str, check_task_id: str = "check", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.job, self.savepoint_name, self.check_task_id = job, savepoint_name, check_task_id

    def execute(self, context: Any) -> dict[str, Any]:
        settings, cluster = self._setup(context)
        old_code = context["ti"].xcom_pull(task_ids=self.check_task_id, key="old_code")
        if not old_code:
            self.log.info("the check never read job %s's code: nothing was changed", self.job)
            return {"rolled_back": False}
        gate = context["ti"].xcom_pull(task_ids="gate", key="stability")
        why = (f"the stability gate failed: {gate['reason']}" if gate and not gate.get("stable")
               else "a step of the update failed before its stability gate")
        run = code_update.rollback(settings, cluster, str(self.job), old_code, self.savepoint_name, why=why)
        if run is None:
            self.log.info("job %s still runs its old code: nothing to roll back", self.job)
            return {"rolled_back": False}
        self.log.warning("job %s rolled back to %s from savepoint %s: run %s", self.job, old_code["code"],
                         self.savepoint_name, run.id)
        return {"rolled_back": True, "run": run.id}


class UpdateSummaryOperator(ChangeoverOperator):
    """Whatever happened upstream: the verdicts, the outcome and the job's downtime, in the log and in XCom.
    The run fails unless the new code is running and stable."""

    template_fields: Sequence[str] = ("changeover_conn_id", "job", "savepoint_name")

    def __init__(self, *, job: str, savepoint_name: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.job, self.savepoint_name = job, savepoint_name

    def execute(self, context: Any) -> dict[str, Any]:
        from airflow.sdk.exceptions import AirflowFailException

        settings, cluster = self._setup(context)
        ti = context["ti"]
        rejected_by = ti.xcom_pull(task_ids="approval", key="rejected_by")
        if rejected_by:  # nothing was stopped: the job runs its old code, as asked
            summary = {"job": self.job, "outcome": f"rejected by {rejected_by}"}
            self.log.info("update of job %s: %s", self.job, summary)
            return summary
        reports = ti.xcom_pull(task_ids="check", key="reports") or {}
        stability = ti.xcom_pull(task_ids="gate", key="stability") or {}
        rolled = ti.xcom_pull(task_ids="rollback") or {}
        old_code = ti.xcom_pull(task_ids="check", key="old_code")
        outcome = code_update.outcome(refused_at_check=bool(ti.xcom_pull(task_ids="check", key="refused")),
                                      resumed=bool(ti.xcom_pull(task_ids="resume")),
                                      stable=bool(stability.get("stable")), rolled_back=bool(rolled.get("rolled_back")),
                                      old_code_runs=code_update.live_run_on(settings, cluster, str(self.job),
                                                                            old_code) is not None)
        summary = {"job": self.job, "outcome": outcome,
                   "verdicts": {job: r["verdict"] for job, r in reports.items()},
                   "stability": stability.get("reason"),
                   "downtime_seconds": code_update.downtime(settings, str(self.job), self.savepoint_name)}
        resumed = ti.xcom_pull(task_ids="resume") or {}
        took = [m for m in move_history.of(settings, str(self.job)) if m.to_run == resumed.get("run")]
        if took and took[-1].zero_downtime:  # its follower's cut-over: how long an input file waited for the sink
            summary.update(strategy="zero_downtime")
            try:
                move_history.record(settings, took[-1:])
                summary.update(largest_gap_seconds=took[-1].freshness, usual_gap_seconds=took[-1].usual_freshness)
            except Exception as exc:  # noqa: BLE001 - a figure the checkpoints cannot give never fails an update
                self.log.warning("update of job %s: its freshness was not measured: %s", self.job, exc)
                summary.update(largest_gap_seconds=f"not measured: {exc}")
        self.log.info("update of job %s: %s", self.job, summary)
        if outcome != "updated":
            raise AirflowFailException(f"job {self.job} was not updated: {outcome}; {summary}")
        return summary
