"""The approval step: the plan shown to a person through Airflow's human-in-the-loop operators, before anything is
drained or stopped. Asked for by a run's `require_approval` Param."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from airflow.providers.standard.operators.hitl import ApprovalOperator
from airflow.sdk.exceptions import AirflowFailException, DownstreamTasksSkipped
from changeover import audit
from changeover.registry.db import session_scope

from changeover_airflow.hooks import ChangeoverHook
from changeover_airflow.operators.base import _bool, acting_settings, upgrade_key


class PlanApprovalOperator(ApprovalOperator):
    """Shows the plan the `plan_task_id` task pushed (XCom key `plan`, one line each) and waits for a person to
    approve or reject it, in the UI's Required Actions. Without `require_approval` it passes at once. Approved, the
    run goes on; rejected, the tasks after it are skipped, and the run's last task ends it as rejected, with nothing
    drained or stopped. Unanswered within `response_timeout` (24 h: the preflight holds the upgrade lock meanwhile)
    the plan counts as rejected. The answer, who gave it (nobody, on a timeout) and the plan it answered are in the
    audit trail (`*.approval`). A retry takes an answer its task instance already got (`_answer_given`); a cleared
    task asks again, and Airflow keeps showing the first try's text, so the plan the answer applies to is the one
    logged, and recorded, by the try that got it."""

    template_fields: Sequence[str] = (*ApprovalOperator.template_fields, "require_approval", "changeover_conn_id")

    def __init__(self, *, require_approval: Any, subject: str, plan_task_id: str, upgrade_step: bool,
                 changeover_conn_id: str = ChangeoverHook.default_conn_name,
                 response_timeout: timedelta = timedelta(hours=24), **kwargs: Any) -> None:
        super().__init__(subject=subject, body="", defaults=self.REJECT, response_timeout=response_timeout,
                         **kwargs)
        self.require_approval, self.plan_task_id = require_approval, plan_task_id
        self.upgrade_step, self.changeover_conn_id = upgrade_step, changeover_conn_id

    def _plan(self, context: Any) -> list[str]:
        return list(context["ti"].xcom_pull(task_ids=self.plan_task_id, key="plan") or [])

    def execute(self, context: Any) -> Any:
        if not _bool(self.require_approval):
            self.log.info("require_approval is off: the plan goes ahead without a person's approval")
            return None
        plan = self._plan(context)
        # a Markdown list: the UI folds a code block's lines into one
        self.body = "\n".join(["The plan, as the preflight made it:", "", *(f"- {line.strip()}" for line in plan),
                               "", "Approve to go ahead; reject to end the run with nothing drained or stopped."])
        for line in plan:
            self.log.info("%s", line)
        given = self._answer_given(context)
        if given is not None:
            self.log.warning("the answer %s was given to this task before Airflow failed the try it resumed (see the "
                             "scheduler's log): taken, not asked again", given["chosen_options"])
            return self.execute_complete(context, given)
        return super().execute(context)

    def _answer_given(self, context: Any) -> dict[str, Any] | None:
        """The answer this task instance already got, as the event its resumed try would have had; None if it was
        never asked or not answered. Airflow 3.3 can fail a try resumed with its answer (the asking try's late exit
        report overrides the resumed state): the retry keeps the task instance's id, its question and the answer, which
        asking again would erase. A cleared task has a new id, and is asked again."""
        from airflow.sdk.execution_time.hitl import get_hitl_detail_content_detail

        try:
            detail = get_hitl_detail_content_detail(context["ti"].id)
        except Exception:  # noqa: BLE001 - none asked under this id: Airflow answers "not found", and the task asks
            return None
        if not detail.response_received or not detail.chosen_options:
            return None
        user = detail.responded_by_user
        return {"chosen_options": detail.chosen_options, "params_input": detail.params_input or {},
                "responded_at": detail.responded_at,
                "responded_by_user": user.model_dump() if hasattr(user, "model_dump") else user}

    def execute_complete(self, context: Any, event: dict[str, Any]) -> Any:
        timed_out = bool(event.get("timedout"))
        person = "nobody (no answer in time)" if timed_out else (
            (event.get("responded_by_user") or {}).get("name") or "an unknown user")
        settings = acting_settings(context, self.changeover_conn_id, self.upgrade_step, person=person)
        what = upgrade_key(context) if self.upgrade_step else f"{context['ti'].dag_id}/{context['ti'].run_id}"
        kind = "upgrade" if self.upgrade_step else "update"
        subject_kind = "upgrade" if self.upgrade_step else "run"
        if "error" in event:  # nothing was answered: Airflow's error is raised by the parent, on record here
            with session_scope(settings.database_url) as s:
                audit.record(s, f"{kind}.approval", subject_kind, what, outcome="failed", approver=person,
                             reason=str(event.get("error")))
            return super().execute_complete(context, event)
        answer = (event.get("chosen_options") or ["(none)"])[0]
        approved = answer == self.APPROVE
        with session_scope(settings.database_url) as s:
            audit.record(s, f"{kind}.approval", subject_kind, what, outcome="approved" if approved else "rejected",
                         approver=person, answer=answer, plan=self._plan(context))
        try:
            if not approved:  # before the parent's skip, which ends this call by raising Airflow's skip signal
                context["ti"].xcom_push(key="rejected_by", value=person)
            return super().execute_complete(context, event)
        except DownstreamTasksSkipped:
            raise
        except Exception as exc:
            # the answer is on record: a retry would ask again, and could reverse it
            raise AirflowFailException(f"the {answer} of {what} by {person} is on record, but taking it failed: {exc}. "
                                       "Clear this task to ask again, or trigger a new run") from exc
