from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from airflow.sdk import Asset, BaseOperator
from airflow.sdk.exceptions import AirflowSkipException
from changeover import jobs, maintenance, roll, savepoints, upgrade, upgrades, verify
from changeover.cluster import LocalCluster
from changeover.settings import Settings
from changeover.windows import DrainWindow

from changeover_airflow.hooks import ChangeoverHook
from changeover_airflow.triggers import ReconcileTrigger


def upgrade_key(context: Any) -> str:
    """An upgrade is its DAG run: run ids are unique only within one DAG."""
    return f"{context['ti'].dag_id}/{context['ti'].run_id}"


class ChangeoverOperator(BaseOperator):
    """Base: resolves the connection and names the person and the task instance as the actor in the audit trail."""

    upgrade_step = False  # a step of an upgrade DAG: its events carry the upgrade's key

    def __init__(self, *, changeover_conn_id: str = ChangeoverHook.default_conn_name, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.changeover_conn_id = changeover_conn_id

    def _setup(self, context: Any) -> tuple[Settings, LocalCluster]:
        ti = context["ti"]
        # The person first: the user who triggered the run (a scheduled run has none), then where it ran.
        user = getattr(context.get("dag_run"), "triggering_user_name", None) or "scheduler"
        os.environ["CHANGEOVER_ACTOR"] = f"{user} via airflow:{ti.dag_id}/{ti.run_id}/{ti.task_id}#{ti.try_number}"
        if self.upgrade_step:
            os.environ["CHANGEOVER_UPGRADE"] = upgrade_key(context)
        settings = ChangeoverHook(self.changeover_conn_id).get_settings()
        return settings, LocalCluster(settings)

    def _skip_if_dry_run(self, context: Any) -> None:
        if context["params"].get("dry_run"):
            raise AirflowSkipException("dry run: nothing is changed")

    def _defer(
        self,
        kind: str,
        subject: str,
        settings: Settings,
        timeout: float | None,
        shutdown_timeout: int | None = None,
        fire_by: datetime | None = None,
    ) -> None:
        self.defer(
            trigger=ReconcileTrigger(kind, subject, {"home": str(settings.home)}, shutdown_timeout,
                                     conn_id=self.changeover_conn_id,
                                     fire_by=fire_by.timestamp() if fire_by else None),
            method_name="execute_complete",
            timeout=timedelta(seconds=timeout) if timeout else None,
        )


class PreflightOperator(ChangeoverOperator):
    """Checks the target version, runtimes, Java and members; returns the members to roll, in order."""

    upgrade_step = True

    template_fields: Sequence[str] = ("target_version", "members")

    def __init__(self, *, target_version: str, members: Any = None, marked_only: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.target_version = target_version
        self.members = members
        self.marked_only = marked_only  # only the members marked for maintenance (a drain window's run)

    def execute(self, context: Any) -> list[str]:
        settings, cluster = self._setup(context)
        requested = list(self.members or [])
        if self.marked_only:
            requested = maintenance.marked(settings)
            if not requested:
                raise AirflowSkipException("no member is marked for maintenance: "
                                           "mark one with `changeover maintenance mark MEMBER`")
        plan = verify.preflight(settings, cluster, self.target_version, requested,
                                upgrade_key=upgrade_key(context), dry_run=bool(context["params"].get("dry_run")))
        for line in plan.describe():
            self.log.info(line)
        return [] if context["params"].get("dry_run") else plan.members


class RollingUpgradeOperator(ChangeoverOperator):
    """Rolls the upgrade's members in order, one at a time: drain, then upgrade, then the next member.

    One task per run walks every member, so no waiting member ever holds a slot the previous member needs
    to retry. Progress lives in the registry: a resumed, retried or spuriously re-run try continues where
    the last one was. Between steps it waits in a trigger, which never fires before the scheduler settles.
    """

    upgrade_step = True

    upgrade_step = True
    template_fields: Sequence[str] = ("shutdown_timeout", "drain_needs_seconds")

    def __init__(
        self,
        *,
        shutdown_timeout: Any = None,
        window: str | None = None,
        drain_needs_seconds: Any = 0,
        roll_timeout: float = 3600,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.shutdown_timeout = shutdown_timeout
        self.window = window  # a drain window: no member's drain starts, or goes on, outside it
        self.drain_needs_seconds = drain_needs_seconds
        self.roll_timeout = roll_timeout

    def execute(self, context: Any, event: dict[str, Any] | None = None) -> dict[str, Any]:
        self._skip_if_dry_run(context)
        settings, cluster = self._setup(context)
        timeout = int(self.shutdown_timeout) if self.shutdown_timeout not in (None, "") else None
        window = DrainWindow.parse(self.window) if self.window else None
        status = roll.step(settings, cluster, upgrade_key(context), timeout, window=window,
                           drain_needs_seconds=float(self.drain_needs_seconds or 0))
        self.log.info("roll %s", status.as_dict())
        if not status.done:
            # with a window, come back when it closes at the latest, to undo a drain it closes on
            opening = window.opening_at(datetime.now(UTC)) if window else None
            self._defer("roll", upgrade_key(context), settings, self.roll_timeout, timeout,
                        fire_by=opening[1] if opening else None)
        return status.as_dict()

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.execute(context, event)


class RebalanceJobsOperator(ChangeoverOperator):
    """Moves fault-tolerant jobs onto the largest version group by savepoint and resume."""

    upgrade_step = True

    def __init__(self, *, rebalance_timeout: float = 900, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rebalance_timeout = rebalance_timeout

    def execute(self, context: Any, event: dict[str, Any] | None = None) -> None:
        self._skip_if_dry_run(context)
        settings, cluster = self._setup(context)
        upgrades.require_active(settings, upgrade_key(context))
        moving = upgrade.rebalance_step(settings, cluster, upgrade_key=upgrade_key(context))
        if moving:
            self.log.info("still moving: %s", moving)
            self._defer("rebalance", "jobs", settings, self.rebalance_timeout)

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None) -> None:
        self.execute(context, event)


class VerifyUpgradeOperator(ChangeoverOperator):
    """Checks every member, the masters and the jobs' placement, then ends the upgrade and frees its lock."""

    upgrade_step = True
    template_fields: Sequence[str] = ("target_version",)

    def __init__(self, *, target_version: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.target_version = target_version

    def execute(self, context: Any) -> dict[str, Any]:
        self._skip_if_dry_run(context)
        settings, cluster = self._setup(context)
        report = verify.verify(settings, cluster, self.target_version, upgrade_key=upgrade_key(context))
        self.log.info("verified: %s", report)
        return report


class FinishUpgradeOperator(ChangeoverOperator):
    """Runs whatever happened upstream: an upgrade not verified by now ended FAILED, and its lock is freed."""

    upgrade_step = True

    def execute(self, context: Any) -> None:
        settings, _ = self._setup(context)
        if context["params"].get("dry_run"):
            return
        if upgrades.release(settings, upgrade_key(context), "FAILED", "the run ended before verify succeeded",
                          missing_ok=True):
            self.log.warning("upgrade %s ended FAILED: its lock is released", upgrade_key(context))


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
