"""The base of Changeover's operators: the connection's settings with the audit trail's actor, the wait in a
trigger between steps (`ChangeoverOperator._defer`), and the few helpers every family uses."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict
from datetime import datetime, timedelta
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowSkipException
from changeover import audit
from changeover.cluster import Membership, membership_for
from changeover.errors import ChangeoverError
from changeover.settings import Settings

from changeover_airflow.hooks import ChangeoverHook
from changeover_airflow.links import ChangeoverViewLink, SparkMasterLink
from changeover_airflow.triggers import ReconcileTrigger


def upgrade_key(context: Any) -> str:
    """An upgrade is its DAG run: run ids are unique only within one DAG."""
    return f"{context['ti'].dag_id}/{context['ti'].run_id}"


def acting_settings(context: Any, conn_id: str, upgrade_step: bool, person: str | None = None) -> Settings:
    """The connection's settings, with the audit trail's actor set: the person first (the user who triggered the run,
    a scheduled run has none; or who answered the task), then where it ran."""
    ti = context["ti"]
    user = person or getattr(context.get("dag_run"), "triggering_user_name", None) or "scheduler"
    audit.act_as(audit.Acting(f"{user} via airflow:{ti.dag_id}/{ti.run_id}/{ti.task_id}#{ti.try_number}",
                              upgrade_key(context) if upgrade_step else None))
    return ChangeoverHook(conn_id).get_settings()


class ChangeoverOperator(BaseOperator):
    """Base: resolves the connection and names the person and the task instance as the actor in the audit trail."""

    upgrade_step = False  # a step of an upgrade DAG: its events carry the upgrade's key
    operator_extra_links = (ChangeoverViewLink(), SparkMasterLink())
    # templated: an upgrade DAG's run chooses its cluster and registry (`params.connection`)
    template_fields: Sequence[str] = ("changeover_conn_id",)

    def __init__(self, *, changeover_conn_id: str = ChangeoverHook.default_conn_name,
                 overall_timeout: float | None = 6 * 3600, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.changeover_conn_id = changeover_conn_id
        self.overall_timeout = overall_timeout  # s a try may spend across all its deferrals

    def _setup(self, context: Any) -> tuple[Settings, Membership]:
        settings = acting_settings(context, self.changeover_conn_id, self.upgrade_step)
        return settings, membership_for(settings)

    def on_kill(self) -> None:
        """A killed task ends the platform commands it runs (a worker's stop or start over ssh): its retry runs them
        again from what it observes, never beside one left running."""
        from changeover.cluster import host_commands

        ended = host_commands.end_all()
        if ended:
            self.log.warning("ended the commands this task ran: %s", "; ".join(ended))

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
        deadline: float | None = None,
        params: dict[str, Any] | None = None,
    ) -> None:
        """Wait in a trigger for the next step: at most `timeout` s for this wait, and never past `deadline`
        (epoch s), which the first deferral of a try sets from `overall_timeout` and each later one carries."""
        if deadline is None and self.overall_timeout:
            deadline = time.time() + self.overall_timeout
        if deadline is not None:
            left = deadline - time.time()
            if left <= 0:
                raise ChangeoverError(
                    f"task {self.task_id} ({kind} {subject})",
                    f"it has waited past its overall deadline of {self.overall_timeout:.0f} s across its waits",
                    "look at what it waits on in the task log and `changeover upgrade status`; clear the task to "
                    "retry with a new deadline, or raise overall_timeout",
                )
            # the trigger fires at the deadline, so the task comes back to say so; the wait's own timeout
            # is only a backstop behind it
            timeout = min(timeout, left + 60) if timeout else left + 60
        fire_at = min(x for x in (fire_by.timestamp() if fire_by else None, deadline) if x is not None) \
            if fire_by or deadline else None
        self.defer(
            trigger=ReconcileTrigger(kind, subject, params, shutdown_timeout,
                                     conn_id=self.changeover_conn_id, fire_by=fire_at,
                                     acting=asdict(acting) if (acting := audit.acting()) else None),
            method_name="execute_complete",
            kwargs={"deadline": deadline},
            timeout=timedelta(seconds=timeout) if timeout else None,
        )


def _bool(value: Any) -> bool:
    """A templated flag: a native bool, or its rendering as text."""
    return value if isinstance(value, bool) else str(value).strip().lower() in ("true", "1", "yes")
