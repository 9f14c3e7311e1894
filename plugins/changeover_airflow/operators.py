from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from airflow.sdk import Asset, BaseOperator
from airflow.sdk.exceptions import AirflowSkipException
from changeover import drain, jobs, savepoints, upgrade, verify
from changeover.cluster import LocalCluster
from changeover.settings import Settings

from changeover_airflow.hooks import ChangeoverHook
from changeover_airflow.triggers import ReconcileTrigger


class ChangeoverOperator(BaseOperator):
    """Base: resolves the connection and names the task instance as the actor in the audit trail."""

    def __init__(self, *, changeover_conn_id: str = ChangeoverHook.default_conn_name, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.changeover_conn_id = changeover_conn_id

    def _setup(self, context: Any) -> tuple[Settings, LocalCluster]:
        ti = context["ti"]
        actor = f"airflow:{ti.dag_id}/{ti.run_id}/{ti.task_id}[{ti.map_index}]#{ti.try_number}"
        os.environ["CHANGEOVER_ACTOR"] = actor
        settings = ChangeoverHook(self.changeover_conn_id).get_settings()
        return settings, LocalCluster(settings)

    def _skip_if_dry_run(self, context: Any) -> None:
        if context["params"].get("dry_run"):
            raise AirflowSkipException("dry run: nothing is changed")

    def _defer(
        self, kind: str, subject: str, settings: Settings, timeout: float | None, shutdown_timeout: int | None = None
    ) -> None:
        self.defer(
            trigger=ReconcileTrigger(
                kind, subject, {"home": str(settings.home), "database_url": settings.database_url}, shutdown_timeout
            ),
            method_name="execute_complete",
            timeout=timedelta(seconds=timeout) if timeout else None,
        )


class PreflightOperator(ChangeoverOperator):
    """Checks the target version, runtimes, Java and members; returns the members to roll, in order."""

    template_fields: Sequence[str] = ("target_version", "members")

    def __init__(self, *, target_version: str, members: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.target_version = target_version
        self.members = members

    def execute(self, context: Any) -> list[str]:
        settings, cluster = self._setup(context)
        plan = verify.preflight(settings, cluster, self.target_version, list(self.members or []),
                                upgrade_key=context["ti"].run_id)
        for line in plan.describe():
            self.log.info(line)
        return [] if context["params"].get("dry_run") else plan.members


class RollMemberOperator(ChangeoverOperator):
    """Drains one member, then upgrades it. Between drain steps it waits in a trigger.

    Drain and upgrade share one task so that a member is back in service before the next member's
    drain starts; the core's one-member-at-a-time gate enforces the same when tasks overlap.
    """

    template_fields: Sequence[str] = ("member", "target_version")

    def __init__(self, *, member: str, target_version: str, drain_timeout: float = 1800, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.member = member
        self.target_version = target_version
        self.drain_timeout = drain_timeout

    def execute(self, context: Any, event: dict[str, Any] | None = None) -> dict[str, str]:
        settings, cluster = self._setup(context)
        result = drain.step(settings, cluster, self.member, context["params"].get("shutdown_timeout"),
                            upgrade_key=context["ti"].run_id)
        self.log.info("drain %s: %s", self.member, result.as_dict())
        if not result.done:
            self._defer("drain", self.member, settings, self.drain_timeout, context["params"].get("shutdown_timeout"))
        old = upgrade.upgrade_member(settings, cluster, self.member, self.target_version)
        self.log.info("member %s: %s -> %s", self.member, old, self.target_version)
        return {"member": self.member, "from": old, "to": self.target_version}

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None) -> dict[str, str]:
        return self.execute(context, event)


class RebalanceJobsOperator(ChangeoverOperator):
    """Moves fault-tolerant jobs onto the largest version group by savepoint and resume."""

    def __init__(self, *, rebalance_timeout: float = 900, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rebalance_timeout = rebalance_timeout

    def execute(self, context: Any, event: dict[str, Any] | None = None) -> None:
        self._skip_if_dry_run(context)
        settings, cluster = self._setup(context)
        moving = upgrade.rebalance_step(settings, cluster, upgrade_key=context["ti"].run_id)
        if moving:
            self.log.info("still moving: %s", moving)
            self._defer("rebalance", "jobs", settings, self.rebalance_timeout)

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None) -> None:
        self.execute(context, event)


class VerifyUpgradeOperator(ChangeoverOperator):
    template_fields: Sequence[str] = ("target_version",)

    def __init__(self, *, target_version: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.target_version = target_version

    def execute(self, context: Any) -> dict[str, Any]:
        self._skip_if_dry_run(context)
        settings, cluster = self._setup(context)
        report = verify.verify(settings, cluster, self.target_version, upgrade_key=context["ti"].run_id)
        self.log.info("verified: %s", report)
        return report


SAVEPOINTS_ASSET = Asset(name="changeover_savepoints", uri="changeover://savepoints")


class SavepointOperator(ChangeoverOperator):
    """Takes a savepoint (mode `continue` or `stop`) and publishes it as an Asset event.

    A retry with the same rendered name returns the savepoint taken before instead of a second one.
    """

    template_fields: Sequence[str] = ("job", "savepoint_name", "mode")

    def __init__(self, *, job: str, savepoint_name: str, mode: str = "continue", **kwargs: Any) -> None:
        kwargs.setdefault("outlets", [SAVEPOINTS_ASSET])
        super().__init__(**kwargs)
        self.job = job
        self.savepoint_name = savepoint_name
        self.mode = mode

    def execute(self, context: Any, event: dict[str, Any] | None = None) -> dict[str, Any]:
        settings, cluster = self._setup(context)
        if self.mode == "stop":
            savepoints.request_stop(settings, self.job, reason=f"savepoint {self.savepoint_name}")
            run = jobs.refresh(settings, cluster, self.job)
            if run is not None and run.state in jobs.LIVE:
                self._defer("stop", self.job, settings, timeout=600)
        sp = savepoints.take(settings, self.job, self.savepoint_name, mode=self.mode, exist_ok=True)
        summary = {"job": sp.job, "savepoint": sp.name, "mode": sp.mode, "size_bytes": sp.size_bytes,
                   "spark_version": sp.spark_version, "stages": sp.stages, "path": sp.path}
        context["outlet_events"][SAVEPOINTS_ASSET].extra = summary
        self.log.info("savepoint %s/%s: %s", sp.job, sp.name, summary)
        return summary

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.execute(context, event)


class ResumeFromSavepointOperator(ChangeoverOperator):
    """Resumes a job from a savepoint on the largest version group; a live job is left as it is."""

    template_fields: Sequence[str] = ("job", "savepoint_name")

    def __init__(self, *, job: str, savepoint_name: str, rename_stages: dict[str, str] | None = None,
                 allow_non_restored_state: bool = False, rewind_sink: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.job = job
        self.savepoint_name = savepoint_name
        self.rename_stages = rename_stages or {}
        self.allow_non_restored_state = allow_non_restored_state
        self.rewind_sink = rewind_sink

    def execute(self, context: Any) -> dict[str, Any]:
        settings, cluster = self._setup(context)
        run = jobs.resume(settings, cluster, self.job, self.savepoint_name, rename_stages=self.rename_stages,
                          allow_non_restored_state=self.allow_non_restored_state, rewind_sink=self.rewind_sink)
        return {"job": self.job, "run": run.id, "spark_version": run.spark_version, "from": run.from_savepoint}


class SavepointMaintenanceOperator(ChangeoverOperator):
    """Applies the retention policy to every fault-tolerant job, then reconciles crashed savepoints."""

    template_fields: Sequence[str] = ("max_count", "max_age_hours")

    def __init__(self, *, max_count: int | None = None, max_age_hours: float | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.max_count = max_count
        self.max_age_hours = max_age_hours

    def execute(self, context: Any) -> dict[str, Any]:
        settings, _ = self._setup(context)
        age = timedelta(hours=self.max_age_hours) if self.max_age_hours is not None else None
        deleted = {name: savepoints.apply_retention(settings, name, self.max_count, age)
                   for name in jobs.fault_tolerant_jobs(settings)}
        removed = savepoints.reconcile(settings)
        self.log.info("retention deleted %s; reconcile removed %s", deleted, removed)
        return {"deleted": deleted, "reconciled": removed}
