"""A deferring task has an overall deadline across its re-deferrals: each wait carries it on, and a try past it
fails naming what it waited on. The operator and Airflow's TaskDeferred are real; no trigger runs here (the
end-to-end tests run the trigger through Airflow's triggerer)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from airflow.sdk.exceptions import TaskDeferred
from changeover.errors import ChangeoverError
from changeover.settings import Settings
from changeover_airflow.operators import RollingUpgradeOperator


def _roll(overall: float) -> RollingUpgradeOperator:
    return RollingUpgradeOperator(task_id="roll", roll_timeout=3600, overall_timeout=overall)


def test_the_first_wait_sets_the_deadline_and_a_later_wait_carries_it(tmp_path: Path) -> None:
    settings = Settings.from_env(home=tmp_path, database_url=f"sqlite:///{tmp_path / 'r.db'}")
    before = time.time()
    with pytest.raises(TaskDeferred) as first:
        _roll(600)._defer("roll", "dag/run", settings, 3600)
    deadline = first.value.kwargs["deadline"]
    assert before + 600 <= deadline <= time.time() + 600
    # the trigger fires at the deadline, so the task itself reports it; the wait's timeout is a backstop
    assert first.value.trigger.fire_by == deadline
    assert first.value.timeout.total_seconds() <= 660

    with pytest.raises(TaskDeferred) as later:
        _roll(600)._defer("roll", "dag/run", settings, 3600, deadline=deadline)
    assert later.value.kwargs["deadline"] == deadline
    assert later.value.method_name == "execute_complete"


def test_the_trigger_carries_the_tasks_actor_and_upgrade_for_the_events_its_polls_write(tmp_path: Path) -> None:
    import contextvars

    from changeover import audit
    from changeover_airflow.triggers import ReconcileTrigger

    settings = Settings.from_env(home=tmp_path, database_url=f"sqlite:///{tmp_path / 'r.db'}")
    acting = audit.Acting("ann via airflow:rolling_upgrade/r1/roll#2", "rolling_upgrade/r1")

    def deferring_task() -> TaskDeferred:  # in a context of its own, as each Airflow task is
        audit.act_as(acting)
        with pytest.raises(TaskDeferred) as deferred:
            _roll(600)._defer("roll", "rolling_upgrade/r1", settings, 3600)
        return deferred.value

    trigger = contextvars.copy_context().run(deferring_task).trigger
    _path, kwargs = trigger.serialize()
    assert ReconcileTrigger(**kwargs).acting == {"actor": acting.actor, "upgrade": acting.upgrade}
    assert audit.acting() is None  # the test's own context was not touched


def test_a_try_past_its_overall_deadline_fails_naming_its_wait(tmp_path: Path) -> None:
    settings = Settings.from_env(home=tmp_path, database_url=f"sqlite:///{tmp_path / 'r.db'}")
    with pytest.raises(ChangeoverError, match=r"task roll \(roll dag/run\).*overall deadline of 600 s.*clear the task"):
        _roll(600)._defer("roll", "dag/run", settings, 3600, deadline=time.time() - 1)


def test_a_master_that_does_not_answer_keeps_the_trigger_polling(settings: Settings) -> None:
    """The master's row points at a port nothing listens on: a real refused connection, not a mock."""
    from changeover import roll, upgrades
    from changeover.ports import free_port
    from changeover.registry.db import session_scope
    from changeover.registry.models import Master, Member, UpgradeRun
    from changeover_airflow.triggers import ready
    from sqlalchemy import select

    with session_scope(settings.database_url) as s:
        s.add(Master(version="4.2.0", host="127.0.0.1", port=free_port(), webui_port=free_port(),
                     rest_port=free_port(), status="RUNNING"))
        s.add(Member(name="m1", version="4.2.0", host="127.0.1.1", status="DRAINING"))
    upgrades.begin(settings, "dag/run", "4.3.0", {"m1": "4.2.0"})
    roll.start(settings, "dag/run", ["m1"])
    with session_scope(settings.database_url) as s:
        run = s.scalar(select(UpgradeRun).where(UpgradeRun.key == "dag/run"))
        run.progress = {**run.progress, "phases": {"m1": roll.DRAINING}}

    actionable, observed = ready("roll", "dag/run", settings, None)

    assert not actionable
    assert "Spark master at http://127.0.0.1:" in observed["unanswered"] and "did not answer" in observed["unanswered"]
