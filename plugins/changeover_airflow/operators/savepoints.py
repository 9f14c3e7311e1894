"""The savepoint operators: a savepoint taken and published as an Asset event, and the retention policy applied."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from airflow.sdk import Asset, AssetAlias
from changeover import jobs, savepoints
from changeover.registry.models import Savepoint

from changeover_airflow.operators.base import ChangeoverOperator

SAVEPOINTS_ASSET = Asset(name="changeover_savepoints", uri="changeover://savepoints")


# update_job's stop and resume: whichever took the update's savepoint publishes it (the resume, at a zero-downtime
# cut-over), and the other publishes nothing rather than an empty event. The Asset itself is declared by
# savepoint_maintenance's tasks, which keeps it active.
SAVEPOINTS_TAKEN = AssetAlias(name="changeover_savepoints_taken")


def _publish(context: Any, outlets: list[Any], sp: Savepoint) -> dict[str, Any]:
    """The savepoint as an event of SAVEPOINTS_ASSET, through the task's alias where it has one."""
    summary = {"job": sp.job, "savepoint": sp.name, "mode": sp.mode, "size_bytes": sp.size_bytes,
               "spark_version": sp.spark_version, "stages": sp.stages, "path": sp.path}
    if SAVEPOINTS_TAKEN in outlets:
        context["outlet_events"][SAVEPOINTS_TAKEN].add(SAVEPOINTS_ASSET, extra=summary)
    else:
        context["outlet_events"][SAVEPOINTS_ASSET].extra = summary
    return summary


# A wait expected to be shorter than this is done in the task: a deferral costs the trigger's settle
# (`triggers.SETTLE_SECONDS`) and two trips through the scheduler, more than a batch boundary usually takes.
IN_TASK_WAIT_SECONDS = 15.0


def _within(condition: Callable[[], bool], seconds: float) -> bool:
    """Whether `condition` holds within `seconds`, polled twice a second in the task."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)
    return True


class SavepointOperator(ChangeoverOperator):
    """Takes a savepoint (mode `continue` or `stop`) and publishes it as an Asset event. In mode `stop` it waits up
    to IN_TASK_WAIT_SECONDS in the task for the job's batch boundary (usually one batch), then in the triggerer.

    A retry with the same rendered name returns the savepoint taken before instead of a second one.
    """

    template_fields: Sequence[str] = ("changeover_conn_id", "job", "savepoint_name", "mode")

    def __init__(self, *, job: str, savepoint_name: str, mode: str = "continue", **kwargs: Any) -> None:
        kwargs.setdefault("outlets", [SAVEPOINTS_ASSET])
        super().__init__(**kwargs)
        self.job = job
        self.savepoint_name = savepoint_name
        self.mode = mode

    def execute(self, context: Any, event: dict[str, Any] | None = None,
                deadline: float | None = None) -> dict[str, Any]:
        settings, cluster = self._setup(context)
        if self.mode == "stop":
            savepoints.request_stop(settings, self.job, reason=f"savepoint {self.savepoint_name}")
            if not _within(lambda: (run := jobs.refresh(settings, cluster, self.job)) is None
                           or run.state not in jobs.LIVE, IN_TASK_WAIT_SECONDS):
                self._defer("stop", self.job, settings, timeout=600, deadline=deadline)
        sp = savepoints.take(settings, self.job, self.savepoint_name, mode=self.mode, exist_ok=True)
        summary = _publish(context, self.outlets, sp)
        self.log.info("savepoint %s/%s: %s", sp.job, sp.name, summary)
        return summary

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None,
                         deadline: float | None = None) -> dict[str, Any]:
        return self.execute(context, event, deadline)


class SavepointMaintenanceOperator(ChangeoverOperator):
    """Applies the retention policy to every fault-tolerant job, then reconciles crashed savepoints."""

    template_fields: Sequence[str] = ("changeover_conn_id", "max_count", "max_age_hours")

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
