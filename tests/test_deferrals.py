"""A deferring task has an overall deadline across its re-deferrals: each wait carries it on, and a try past it
fails naming what it waited on. The operator and Airflow's TaskDeferred are real; no trigger runs here (the
end-to-end tests run the trigger through Airflow's triggerer)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from airflow.sdk.exceptions import TaskDeferred
from changeover.errors import ChangeoverError
from changeover.settings import Settings
from changeover.timeutil import as_utc
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
    from changeover.cluster.ports import free_port
    from changeover.registry.db import session_scope
    from changeover.registry.models import Master, Member, UpgradeRun
    from changeover.upgrade import lock, roll
    from changeover_airflow.triggers import ready
    from sqlalchemy import select

    with session_scope(settings.database_url) as s:
        s.add(Master(version="4.2.0", host="127.0.0.1", port=free_port(), webui_port=free_port(),
                     rest_port=free_port(), status="RUNNING"))
        s.add(Member(name="m1", version="4.2.0", host="127.0.1.1", status="DRAINING"))
    lock.begin(settings, "dag/run", "4.3.0", {"m1": "4.2.0"})
    roll.start(settings, "dag/run", ["m1"])
    with session_scope(settings.database_url) as s:
        run = s.scalar(select(UpgradeRun).where(UpgradeRun.key == "dag/run"))
        run.progress = {**run.progress, "phases": {"m1": roll.DRAINING}}

    actionable, observed = ready("roll", "dag/run", settings, None)

    assert not actionable
    assert "Spark master at http://127.0.0.1:" in observed["unanswered"] and "did not answer" in observed["unanswered"]


def test_the_stability_gate_waits_in_the_triggerer_and_decides_when_it_fires(
        settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gate defers instead of sleeping in a worker slot: its trigger fires once the job is stable (or its run
    ended), and at the gate's deadline at the latest. The task's runtime context is a stand-in (a TI that records
    XComs); the registry, the operator, its trigger's observation and Airflow's TaskDeferred are real."""
    import contextvars
    from types import SimpleNamespace

    from airflow.sdk.exceptions import AirflowFailException
    from changeover import audit
    from changeover.registry.db import session_scope
    from changeover.registry.models import Job, JobRun, Savepoint, utcnow
    from changeover_airflow.operators import StabilityGateOperator
    from changeover_airflow.triggers import ready

    with session_scope(settings.database_url) as s:
        s.add(Job(name="clicks", module="m", fault_tolerant=True, block_shutdown=False, options={}))
        s.flush()
        stopped = JobRun(job="clicks", spark_version="4.2.0", master_url="spark://x", state="STOPPED",
                         progress={"totals": 2}, ended_at=utcnow())  # the run the update stopped
        run = JobRun(job="clicks", spark_version="4.2.0", master_url="spark://x", state="RUNNING",
                     progress={"totals": 3})
        s.add_all([stopped, run])
        s.flush()
        s.get(Job, "clicks").make_current(run)
        s.add(Savepoint(job="clicks", name="update-1", mode="stop", status="COMPLETED", path="/nowhere",
                        size_bytes=0, spark_version="4.2.0", stages={"totals": 2}, run_id=stopped.id))
        run_id, launched = run.id, as_utc(run.submitted_at).timestamp()
    connection = {"conn_type": "generic", "extra": {"home": str(settings.home), "database_url": settings.database_url}}
    monkeypatch.setenv("AIRFLOW_CONN_CHANGEOVER_DEFAULT", json.dumps(connection))
    pushed: dict[str, object] = {}
    resumed = {"run": run_id}  # what the resume task returned
    ti = SimpleNamespace(dag_id="update_job", run_id="r1", task_id="gate", try_number=1,
                         xcom_push=lambda key, value: pushed.update({key: value}),
                         xcom_pull=lambda task_ids: resumed if task_ids == "resume" else None)
    context = {"ti": ti, "params": {}, "dag_run": None}
    gate = StabilityGateOperator(task_id="gate", job="clicks", savepoint_name="update-1", batches=3,
                                 max_lag_seconds=60, gate_timeout=300)

    def in_task(call: Any, *args: Any) -> Any:  # each Airflow task runs in a context of its own (its actor)
        return contextvars.copy_context().run(call, *args)

    with pytest.raises(TaskDeferred) as deferred:
        in_task(gate.execute, context)  # 1 of 3 batches since the savepoint
    trigger, deadline = deferred.value.trigger, deferred.value.kwargs["deadline"]
    assert (trigger.kind, trigger.subject, trigger.params["savepoint"]) == ("stable", "clicks", "update-1")
    # from the run's launch, so a later try of the task (a retry after its worker died) keeps the same deadline
    assert deadline == pytest.approx(launched + 300) and trigger.fire_by == pytest.approx(deadline, abs=0.001)
    ti.try_number = 2
    with pytest.raises(TaskDeferred) as retried:
        in_task(gate.execute, context)
    assert retried.value.kwargs["deadline"] == deadline
    resumed["run"] = run_id + 1  # the job's run is not the one the resume task started (a rollback's, say)
    starting = time.time()
    with pytest.raises(TaskDeferred) as other:
        in_task(gate.execute, context)
    assert starting + 300 <= other.value.kwargs["deadline"] <= time.time() + 300  # timed from this try's start
    resumed["run"] = run_id
    assert ready("stable", "clicks", settings, None, trigger.params) == (
        False, {"stable": False, "reason": "1 of 3 batches committed"})

    with session_scope(settings.database_url) as s:
        committed = s.get(JobRun, run_id)
        committed.progress, committed.last_commit_at = {"totals": 5}, committed.submitted_at
    assert ready("stable", "clicks", settings, None, trigger.params)[0]
    assert in_task(gate.execute_complete, context, {}, deadline)["stable"]
    assert pushed["stability"]["batches"] == 3

    with session_scope(settings.database_url) as s:
        s.get(JobRun, run_id).state = "FAILED"
    with pytest.raises(AirflowFailException, match=f"run {run_id} is FAILED"):
        in_task(gate.execute, context)  # an ended run: no wait at all
    outcomes = [e.outcome for e in audit.find(settings.database_url, job="clicks") if e.action == "job.stability"]
    assert outcomes == ["passed", "failed"]
    assert audit.acting() is None  # the test's own context was not touched


def test_the_trigger_fires_no_sooner_than_its_settle_time_though_ready_at_once(settings: Settings,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The other half of the deferral race's fix (tests/e2e/dags/deferral_race.py, in `make test-e2e`): a deferred task
    resumed at once can race its own exit's report, so the trigger waits out its settle time first. The observation
    is replaced here (it is ready at once), and the hook hands over the test's registry instead of a connection's."""
    import asyncio

    from changeover_airflow import hooks, triggers

    monkeypatch.setattr(hooks.ChangeoverHook, "get_settings", lambda self: settings)
    monkeypatch.setattr(triggers, "ready", lambda *args: (True, {"drained": True}))
    trigger = triggers.ReconcileTrigger("drain", "m1", poll_interval=0.05, settle_seconds=1.5)

    async def first_event() -> tuple[float, object]:
        began = time.monotonic()
        async for event in trigger.run():
            return time.monotonic() - began, event
        raise AssertionError("the trigger ended without an event")

    waited, event = asyncio.run(first_event())
    assert waited >= 1.5 and event.payload["observed"] == {"drained": True}  # type: ignore[attr-defined]


class _OutletEvents(dict):
    """What Airflow hands a task as context["outlet_events"]: an accessor per outlet, made on first use."""

    def __missing__(self, key: object) -> Any:
        self[key] = accessor = type("Accessor", (), {"extra": None, "add": lambda self, *a, **k: None})()
        return accessor


def test_a_stop_savepoint_waits_in_the_task_then_in_the_triggerer_and_is_taken_once_stopped(
        settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SavepointOperator in mode stop: a boundary within IN_TASK_WAIT_SECONDS is waited for in the task (the e2e
    update's stops take about a second); a longer one defers to the `stop` trigger, and the task taken up again
    takes the savepoint. The fleet is fake (tests/fake_fleet.py): its master reports the job's driver running."""
    from changeover import jobs
    from changeover.registry.db import session_scope
    from changeover.registry.models import Job, JobRun, utcnow
    from changeover_airflow import operators
    from fake_fleet import FakeFleet

    fleet = FakeFleet(settings)
    fleet.up([("m1", "4.2.0")])
    submission = fleet.master("4.2.0").create({"appArgs": []})
    fleet.driver(submission).host, fleet.driver(submission).state = "m1", "RUNNING"
    stage = tmp_path / "cp" / "totals"
    for folder in ("offsets", "commits"):
        (stage / folder).mkdir(parents=True)
        (stage / folder / "0").write_text("v1\n{}\n")
    with session_scope(settings.database_url) as s:
        s.add(Job(name="clicks", module="m", fault_tolerant=True, block_shutdown=False, options={}))
        s.flush()
        run = JobRun(job="clicks", spark_version="4.2.0", master_url="spark://fake", state="RUNNING", progress={},
                     member="m1", submission_id=submission, heartbeat_at=utcnow(),
                     checkpoint_root=str(tmp_path / "cp"))
        s.add(run)
        s.flush()
        s.get(Job, "clicks").make_current(run)
        run_id = run.id
    operator = operators.SavepointOperator(task_id="stop", job="clicks", savepoint_name="sp", mode="stop")
    monkeypatch.setattr(operator, "_setup", lambda context: (settings, fleet))
    monkeypatch.setattr(operators.savepoints, "IN_TASK_WAIT_SECONDS", 0.2)  # the job's batch outlasts it
    context = {"outlet_events": _OutletEvents()}
    with pytest.raises(TaskDeferred) as deferred:
        operator.execute(context)
    assert deferred.value.trigger.kind == "stop" and deferred.value.method_name == "execute_complete"
    with session_scope(settings.database_url) as s:
        assert s.get(Job, "clicks").desired == "STOP"
        s.get(JobRun, run_id).state = "STOPPED"  # as its driver reports at the boundary
    fleet.driver(submission).state = "FINISHED"
    taken = operator.execute_complete(context, deferred.value.kwargs["deadline"])
    assert (taken["savepoint"], taken["mode"], taken["stages"]) == ("sp", "stop", {"totals": 0})
    assert context["outlet_events"][operators.SAVEPOINTS_ASSET].extra == taken
    assert jobs.refresh(settings, fleet, "clicks").state == "STOPPED"
