"""The version upgrade's operators: preflight, the roll of the members, the rebalance of the jobs, verify and the
run's last task (`chains.upgrade_chain` lays them out)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from airflow.sdk.exceptions import AirflowSkipException
from changeover.errors import NeedsOperator
from changeover.upgrade import lock, maintenance, member_upgrade, roll, verify
from changeover.upgrade.windows import DrainWindow
from changeover.upgrade.zero_downtime import CatchUp

from changeover_airflow.operators.base import ChangeoverOperator, upgrade_key


class PreflightOperator(ChangeoverOperator):
    """Checks the target version, runtimes, Java and members; returns the members to roll, in order."""

    upgrade_step = True

    template_fields: Sequence[str] = ("changeover_conn_id", "target_version", "members")

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
                context["ti"].xcom_push(key="skipped", value="no member is marked for maintenance")
                raise AirflowSkipException("no member is marked for maintenance: "
                                           "mark one with `changeover maintenance mark MEMBER`")
        plan = verify.preflight(settings, cluster, self.target_version, requested,
                                upgrade_key=upgrade_key(context), dry_run=bool(context["params"].get("dry_run")))
        for line in plan.describe():
            self.log.info(line)
        context["ti"].xcom_push(key="plan", value=plan.describe())  # what an approver is shown
        return [] if context["params"].get("dry_run") else plan.members


class RollingUpgradeOperator(ChangeoverOperator):
    """Rolls the upgrade's members in order, one at a time: drain, then upgrade, then the next member.

    One task per run walks every member, so no waiting member ever holds a slot the previous member needs
    to retry. Progress lives in the registry: a resumed, retried or spuriously re-run try continues where
    the last one was. Between steps it waits in a trigger, which never fires before the scheduler settles.
    """

    upgrade_step = True
    template_fields: Sequence[str] = ("changeover_conn_id", "shutdown_timeout", "drain_needs_seconds", "surge",
                                      "move_strategy", "catch_up_seconds")

    def __init__(
        self,
        *,
        shutdown_timeout: Any = None,
        window: str | None = None,
        drain_needs_seconds: Any = 0,
        roll_timeout: float = 3600,
        surge: Any = 0,
        move_strategy: Any = None,
        catch_up_seconds: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.surge = surge  # temporary members at the target for the upgrade's length
        self.move_strategy = move_strategy  # warm or zero_downtime; None: each job's option
        self.catch_up_seconds = catch_up_seconds
        self.shutdown_timeout = shutdown_timeout
        self.window = window  # a drain window: no member's drain starts, or goes on, outside it
        self.drain_needs_seconds = drain_needs_seconds
        self.roll_timeout = roll_timeout

    def execute(self, context: Any, event: dict[str, Any] | None = None,
                deadline: float | None = None) -> dict[str, Any]:
        self._skip_if_dry_run(context)
        settings, cluster = self._setup(context)
        timeout = int(self.shutdown_timeout) if self.shutdown_timeout not in (None, "") else None
        window = DrainWindow.parse(self.window) if self.window else None
        catch_up = CatchUp(float(self.catch_up_seconds or CatchUp.seconds))
        try:
            status = roll.step(settings, cluster, upgrade_key(context), timeout, window=window,
                               drain_needs_seconds=float(self.drain_needs_seconds or 0),
                               surge=int(self.surge or 0), move_strategy=self.move_strategy or None,
                               catch_up=catch_up)
        except NeedsOperator as exc:  # a retry would meet the same refusal: fail now, with what to do
            from airflow.sdk.exceptions import AirflowFailException

            raise AirflowFailException(str(exc)) from exc
        self.log.info("roll %s", status.as_dict())
        if not status.done:
            # with a window, come back when it closes at the latest, to undo a drain it closes on
            opening = window.opening_at(datetime.now(UTC)) if window else None
            # the trigger waits out a follower's catch-up too (`zero_downtime.waiting_on_successor`)
            self._defer("roll", upgrade_key(context), settings, max(self.roll_timeout, catch_up.seconds + 600), timeout,
                        fire_by=opening[1] if opening else None, deadline=deadline)
        return status.as_dict()

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None,
                         deadline: float | None = None) -> dict[str, Any]:
        return self.execute(context, event, deadline)


class RebalanceJobsOperator(ChangeoverOperator):
    """Moves fault-tolerant jobs onto the largest version group by savepoint and resume."""

    upgrade_step = True

    def __init__(self, *, rebalance_timeout: float = 900, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rebalance_timeout = rebalance_timeout

    def execute(self, context: Any, event: dict[str, Any] | None = None, deadline: float | None = None) -> None:
        self._skip_if_dry_run(context)
        settings, cluster = self._setup(context)
        lock.require_active(settings, upgrade_key(context))
        moving = member_upgrade.rebalance_step(settings, cluster, upgrade_key=upgrade_key(context))
        if moving:
            self.log.info("still moving: %s", moving)
            self._defer("rebalance", "jobs", settings, self.rebalance_timeout, deadline=deadline)

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None,
                         deadline: float | None = None) -> None:
        self.execute(context, event, deadline)


class VerifyUpgradeOperator(ChangeoverOperator):
    """Checks every member, the masters and the jobs' placement, then ends the upgrade and frees its lock."""

    upgrade_step = True
    template_fields: Sequence[str] = ("changeover_conn_id", "target_version",)

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
    """Runs whatever happened upstream: an upgrade not verified by now ends FAILED, its lock is freed, and the
    task fails, so that the run does too."""

    upgrade_step = True

    def execute(self, context: Any) -> None:
        settings, _ = self._setup(context)
        if context["params"].get("dry_run"):
            return
        from airflow.sdk.exceptions import AirflowFailException

        key = upgrade_key(context)
        rejected_by = context["ti"].xcom_pull(task_ids="approval", key="rejected_by")
        if rejected_by:  # the plan was rejected before anything drained: the run ends as asked, not failed
            lock.release(settings, key, "REJECTED", f"its plan was rejected by {rejected_by}", missing_ok=True)
            return
        released = lock.release(settings, key, "FAILED", "the run ended before verify succeeded", missing_ok=True)
        if context["ti"].xcom_pull(task_ids="preflight", key="skipped"):
            return  # nothing to upgrade this time: no upgrade began
        if lock.status(settings, key) != "SUCCEEDED":
            # the run's only leaf: failing here is what shows the run as failed in the UI
            freed = "; its lock is released" if released else ""
            raise AirflowFailException(
                f"upgrade {key} did not succeed{freed}. Read the failed task's log for the reason. "
                f"`changeover upgrade status {key}` shows where it stopped, `changeover upgrade abort {key}` returns "
                f"its members to service, `changeover upgrade resume {key}` lets its cleared tasks go on")
