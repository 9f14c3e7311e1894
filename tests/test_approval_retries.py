"""The approval task's retry after Airflow 3.3 failed the try it resumed with a person's answer: it takes that answer
rather than asking again, and a try that never got one asks. Airflow's task supervisor, which the operator asks for
the task's human-in-the-loop detail and to which it writes its question, runs only inside a task: both calls are
replaced here, and nothing else is. The end-to-end tests run the approval through the scheduler and the UI."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest
from airflow.sdk.api.datamodels._generated import HITLDetailResponse
from airflow.sdk.exceptions import TaskAwaitingInput
from airflow.sdk.execution_time import hitl
from changeover_airflow.approval import PlanApprovalOperator

PLAN = ["target Spark 4.3.0; members in order: m1", "m1: 4.2.0 -> 4.3.0"]


class _TaskInstance(SimpleNamespace):
    def xcom_pull(self, task_ids: str, key: str) -> Any:
        return PLAN if (task_ids, key) == ("preflight", "plan") else None


def _approval() -> PlanApprovalOperator:
    return PlanApprovalOperator(task_id="approval", require_approval=True, subject="Approve?",
                                plan_task_id="preflight", upgrade_step=True)


def _context() -> dict[str, Any]:
    ti = _TaskInstance(id="0199-ti")
    return {"ti": ti, "task_instance": ti}


def test_a_retry_takes_the_answer_its_failed_try_was_resumed_with(monkeypatch: pytest.MonkeyPatch) -> None:
    answered = HITLDetailResponse(response_received=True, responded_by_user={"id": "admin", "name": "admin"},
                                  responded_at=datetime(2026, 11, 29, 8, 9, 35, tzinfo=UTC),
                                  chosen_options=["Reject"], params_input={})
    asked_for: list[Any] = []
    monkeypatch.setattr(hitl, "get_hitl_detail_content_detail", lambda ti_id: asked_for.append(ti_id) or answered)
    monkeypatch.setattr("airflow.providers.standard.operators.hitl.upsert_hitl_detail",
                        lambda **_: pytest.fail("asked again, erasing the answer"))
    approval, completed = _approval(), []
    monkeypatch.setattr(approval, "execute_complete", lambda context, event: completed.append(event) or "taken")

    assert approval.execute(_context()) == "taken"
    assert asked_for == ["0199-ti"]  # the task instance's own detail: a cleared task's new id has none
    (event,) = completed
    assert event["chosen_options"] == ["Reject"] and event["responded_by_user"]["name"] == "admin"
    assert event["responded_at"] == answered.responded_at


@pytest.mark.parametrize("detail", [
    pytest.param(HITLDetailResponse(response_received=False, responded_at=None, chosen_options=None), id="unanswered"),
    pytest.param(LookupError("no human-in-the-loop detail for this task instance"), id="never-asked"),
])
def test_a_try_without_an_answer_asks(monkeypatch: pytest.MonkeyPatch, detail: Any) -> None:
    def lookup(ti_id: str) -> HITLDetailResponse:
        if isinstance(detail, Exception):
            raise detail
        return detail

    asked: list[dict[str, Any]] = []
    monkeypatch.setattr(hitl, "get_hitl_detail_content_detail", lookup)
    monkeypatch.setattr("airflow.providers.standard.operators.hitl.upsert_hitl_detail", lambda **kw: asked.append(kw))
    approval = _approval()
    monkeypatch.setattr(approval, "execute_complete", lambda context, event: pytest.fail(f"took {event} unasked"))
    with pytest.raises(TaskAwaitingInput):  # Airflow's signal that the task waits for its answer
        approval.execute(_context())
    (question,) = asked
    assert question["ti_id"] == "0199-ti" and "- m1: 4.2.0 -> 4.3.0" in question["body"]
