"""The leak checker (`changeover.housekeeping.leaks`) over a fake fleet (tests/fake_fleet.py) and the real registry, on
SQLite and PostgreSQL, in seconds. Time is the check's `now`: a leak first seen at t0 is left alone until t0 + the
grace, and cleaned from then on; nothing registered is touched at any time."""

from __future__ import annotations

import contextvars
import json
import os
import socket
from collections import Counter
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from changeover import jobs
from changeover.cli.generator import Generator
from changeover.cluster import LocalCluster, processes, wait_for
from changeover.housekeeping import leaks
from changeover.light import ledger
from changeover.registry.db import session_scope
from changeover.registry.models import Event, Job, JobRun, LightJob, Savepoint, utcnow
from changeover.runtime.sinks import files
from changeover.settings import Settings
from conftest import ONE_REGISTRY, TRIGGER, drivers_of
from fake_fleet import FakeFleet
from sqlalchemy import select

VERSION = "4.2.0"
GRACE = 600
CHECKOUT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fleet(settings: Settings) -> FakeFleet:
    fleet = FakeFleet(settings)
    fleet.up([("m1", VERSION), ("m2", VERSION)])
    return fleet


def _run(fleet: FakeFleet, job: str, *, state: str = "RUNNING", driver: str = "RUNNING", heard: Any = None,
         ended: bool = False, current: bool = True, standby_of: int | None = None,
         sinks: dict[str, Any] | None = None) -> tuple[int, str]:
    """A run of `job` whose driver is on the fake master in Spark's state `driver`: its id and submission."""
    submission = fleet.master(VERSION).create({"sparkProperties": {"spark.app.name": f"changeover-{job}"}})
    fleet.driver(submission).state = driver
    with session_scope(fleet.settings.database_url) as s:
        if s.get(Job, job) is None:
            s.add(Job(name=job, module="m", fault_tolerant=True, block_shutdown=False, options={}))
            s.flush()
        run = JobRun(job=job, spark_version=VERSION, master_url="spark://fake", state=state, progress={},
                     member="m1", submission_id=submission, heartbeat_at=heard or utcnow(),
                     ended_at=utcnow() if ended else None, sinks=sinks, standby_of=standby_of)
        s.add(run)
        s.flush()
        if current and not ended:
            s.get(Job, job).make_current(run)
        return run.id, submission


def _half_written_savepoint(settings: Settings) -> Path:
    """A `continue` savepoint whose builder on this host died while copying: its PENDING row and its staging."""
    owner = f"{socket.gethostname()}:999999:1"  # a PID that runs nothing, so nobody holds it
    with session_scope(settings.database_url) as s:
        s.add(Job(name="clicks", module="m", fault_tolerant=True, block_shutdown=False, options={}))
        s.flush()
        s.add(Savepoint(job="clicks", name="sp1", mode="continue", status="PENDING",
                        path=str(settings.savepoint_dir / "clicks" / "sp1"), size_bytes=0, spark_version=VERSION,
                        stages={"totals": 1}, owner=owner, lease_until=utcnow() + timedelta(seconds=GRACE)))
    copied = (settings.savepoint_dir / "clicks" / ".staging-sp1" / owner.replace(":", "-") / "stages" / "totals"
              / "offsets")
    copied.mkdir(parents=True)
    (copied / "0").write_text("v1\n")  # one batch's offsets copied of two
    return settings.savepoint_dir / "clicks" / ".staging-sp1"


def _states(report: leaks.LeakReport) -> dict[tuple[str, str], str]:
    return {(leak["kind"], leak["subject"]): leak["state"] for leak in report.found}


def _events(settings: Settings, action: str) -> list[tuple[str, str]]:
    with session_scope(settings.database_url) as s:
        return [(e.subject_kind, e.subject) for e in s.scalars(select(Event).where(Event.action == action)
                                                               .order_by(Event.id))]


def _run_row(settings: Settings, run_id: int) -> JobRun:
    with session_scope(settings.database_url) as s:
        run = s.get(JobRun, run_id)
        assert run is not None
        return run


def test_an_orphaned_driver_and_a_half_written_savepoint_are_left_within_the_grace_and_cleaned_after(
        fleet: FakeFleet, settings: Settings) -> None:
    orphan = fleet.master(VERSION).create({"sparkProperties": {"spark.app.name": "changeover-gone"}})
    staging = _half_written_savepoint(settings)
    driver, row, folder = ("driver", f"{VERSION}/{orphan}"), ("savepoint", "clicks/sp1"), \
        ("savepoint_folder", "clicks/.staging-sp1")
    t0 = utcnow()
    for seconds in (0, GRACE - 1):  # within the grace: only reported
        report = leaks.check(settings, fleet, GRACE, now=t0 + timedelta(seconds=seconds))
        assert {key: _states(report)[key] for key in (driver, row, folder)} == dict.fromkeys((driver, row, folder),
                                                                                           "waiting")
        assert report.cleaned == [] and report.refused == []
        assert fleet.driver(orphan).state == "RUNNING" and staging.is_dir()
    assert fleet.master(VERSION).calls["kill"] == 0

    report = leaks.check(settings, fleet, GRACE, now=t0 + timedelta(seconds=GRACE))
    assert {(c["kind"], c["subject"]) for c in report.cleaned} == {driver, row, folder}
    assert fleet.driver(orphan).state == "KILLED"  # through its master's REST kill
    assert not staging.exists()
    with session_scope(settings.database_url) as s:
        assert s.scalars(select(Savepoint)).all() == []
    found = Counter(_events(settings, "leak.found"))
    assert (found[driver], found[row], found[folder]) == (1, 1, 1)  # first seen once, the grace counted from it
    assert {driver, row, folder} <= set(_events(settings, "leak.cleaned"))
    with session_scope(settings.database_url) as s:
        cleaned = s.scalar(select(Event).where(Event.action == "leak.cleaned", Event.subject == driver[1]))
        assert cleaned.details["driver"] == orphan and cleaned.details["first_seen"] == t0.isoformat(timespec="seconds")

    # the orphan's application is only reported, never ended by its name: it went with its driver
    app = ("app", f"{VERSION}/app-{orphan}")
    assert _states(report)[app] == "reported"
    after = leaks.check(settings, fleet, GRACE, now=t0 + timedelta(seconds=GRACE + 1))
    assert after.found == [] and after.gone == [f"app {app[1]}"]
    assert _events(settings, "leak.gone") == [app]


def test_a_leak_whose_name_outgrows_the_events_subject_is_still_remembered_and_cleaned(fleet: FakeFleet,
                                                                                        settings: Settings) -> None:
    """A job and a savepoint name of 100 characters each: their staging folder's name is longer than an event's
    subject may be (PostgreSQL refuses it), so the subject keeps its start and a digest of the whole."""
    job, name = "j" * 100, "s" * 100
    staging = settings.savepoint_dir / job / f".staging-{name}" / "host-1-1"
    staging.mkdir(parents=True)
    t0 = utcnow()
    [waiting] = leaks.check(settings, fleet, GRACE, now=t0).found
    assert waiting["state"] == "waiting" and len(waiting["subject"]) == 200
    [cleaned] = leaks.check(settings, fleet, GRACE, now=t0 + timedelta(seconds=GRACE)).cleaned
    assert cleaned["subject"] == waiting["subject"] and not staging.parent.exists()


@pytest.mark.parametrize(("state", "ended_as"), [("RUNNING", "KILLED"), ("PARKED", "STOPPED")])
def test_a_run_whose_driver_spark_no_longer_reports_is_found_and_ended_once_silent_past_the_grace(
        fleet: FakeFleet, settings: Settings, state: str, ended_as: str) -> None:
    t0 = utcnow()
    ghost, submission = _run(fleet, "clicks", state=state, heard=t0)
    speaking, heard_late = _run(fleet, "views", state=state, heard=t0 + timedelta(seconds=GRACE - 10))
    for lost in (submission, heard_late):  # their master lost them (restarted without recovery, say)
        del fleet.master(VERSION).drivers[lost]
    first = leaks.check(settings, fleet, GRACE, now=t0)
    assert _states(first) == {("run", f"clicks/run-{ghost}"): "waiting", ("run", f"views/run-{speaking}"): "waiting"}
    assert _run_row(settings, ghost).ended_at is None

    later = leaks.check(settings, fleet, GRACE, now=t0 + timedelta(seconds=GRACE))
    assert _states(later) == {("run", f"clicks/run-{ghost}"): "cleaned",
                              # heard 10 s before: its driver lives, wherever its master lost it
                              ("run", f"views/run-{speaking}"): "waiting"}
    ended = _run_row(settings, ghost)
    assert ended.state == ended_as and ended.ended_at is not None and "leak checker" in ended.error
    alive = _run_row(settings, speaking)
    assert alive.state == state and alive.ended_at is None
    with session_scope(settings.database_url) as s:
        assert s.get(Job, "clicks").desired == "RUN"  # ended as a lost driver is, not cancelled


def test_a_run_whose_driver_speaks_between_the_look_and_the_cleanup_is_left_alone(fleet: FakeFleet,
                                                                                   settings: Settings) -> None:
    t0 = utcnow()
    ghost, submission = _run(fleet, "clicks", heard=t0)
    del fleet.master(VERSION).drivers[submission]
    leaks.check(settings, fleet, GRACE, now=t0)
    later = t0 + timedelta(seconds=GRACE)
    seen = leaks.observe(settings, fleet, GRACE)
    assert leaks.decide(seen, later).clean  # due, as seen
    with session_scope(settings.database_url) as s:
        s.get(JobRun, ghost).heartbeat_at = later  # its driver speaks meanwhile
    report = leaks.act(settings, fleet, leaks.decide(seen, later), later)
    assert _states(report) == {("run", f"clicks/run-{ghost}"): "gone"}
    assert _run_row(settings, ghost).ended_at is None
    assert ("run", f"clicks/run-{ghost}") in _events(settings, "leak.gone")


def test_a_stale_pid_file_is_removed_and_a_running_groups_kept(fleet: FakeFleet, settings: Settings,
                                                                tmp_path: Path) -> None:
    pids = settings.cluster_dir / "pids"
    pids.mkdir(parents=True)
    gone = pids / "worker-m9.pid"
    gone.write_text("999999999 1\n")  # its process is long gone
    recycled = pids / "master-4.1.0.pid"
    recycled.write_text(f"{os.getpid()} 0\n")  # its PID runs again, another process: not ours
    started = processes.spawn(["sleep", "300"], dict(os.environ), tmp_path / "sleep.log")
    try:
        live = pids / "connect-m1.pid"
        live.write_text(f"{started.pid} {started.start_ticks}\n")
        report = leaks.check(settings, fleet, 0)  # no grace: cleaned when first seen
        assert {c["subject"] for c in report.cleaned} == {"worker-m9.pid", "master-4.1.0.pid"}
        assert not gone.exists() and not recycled.exists() and live.exists()
        assert processes.is_running(started.pid, started.start_ticks)
    finally:
        processes.stop_group(started.pid, started.start_ticks, timeout=5)


def test_a_running_light_job_whose_connect_server_is_gone_is_ended(settings: Settings) -> None:
    fleet = FakeFleet(settings)
    fleet.up([("m1", VERSION), ("m2", VERSION)], light_jobs=True)
    lost = ledger.register(settings, "m1", VERSION, "sc://127.0.1.1:1", "s1", "alice", statement="SELECT 1",
                           block_shutdown=True, shutdown_timeout=30)
    kept = ledger.register(settings, "m2", VERSION, "sc://127.0.1.2:1", "s2", "bob", statement="SELECT 2",
                           block_shutdown=True, shutdown_timeout=30)
    # m1's Connect server died: gone from its master, while the registry still records it
    del fleet.connect_servers["m1"], fleet.master(VERSION).apps["app-connect-m1"]
    t0 = utcnow()
    assert _states(leaks.check(settings, fleet, GRACE, now=t0)) == {("light_job", lost.tag): "waiting"}
    assert ledger.get(settings, lost.tag).state == "RUNNING"

    report = leaks.check(settings, fleet, GRACE, now=t0 + timedelta(seconds=GRACE))
    assert [(c["kind"], c["subject"]) for c in report.cleaned] == [("light_job", lost.tag)]
    ended = ledger.get(settings, lost.tag)
    assert ended.state == "INTERRUPTED" and "Connect server is not" in ended.error
    assert ledger.get(settings, kept.tag).state == "RUNNING"
    assert ("light_job", lost.tag) in _events(settings, "light.end")


def test_a_running_light_job_whose_client_went_silent_is_ended(settings: Settings) -> None:
    fleet = FakeFleet(settings)
    fleet.up([("m1", VERSION)], light_jobs=True)
    silent = ledger.register(settings, "m1", VERSION, "sc://127.0.1.1:1", "s1", "alice", statement="SELECT 1",
                             block_shutdown=True, shutdown_timeout=30)
    talking = ledger.register(settings, "m1", VERSION, "sc://127.0.1.1:1", "s2", "bob", statement="SELECT 2",
                              block_shutdown=True, shutdown_timeout=30)
    with session_scope(settings.database_url) as s:
        s.scalar(select(LightJob).where(LightJob.tag == silent.tag)).heartbeat_at = (
            utcnow() - timedelta(seconds=ledger.SILENCE_SECONDS + 1))
    t0 = utcnow()
    assert _states(leaks.check(settings, fleet, GRACE, now=t0)) == {("light_job", silent.tag): "waiting"}
    report = leaks.check(settings, fleet, GRACE, now=t0 + timedelta(seconds=GRACE))
    assert [(c["kind"], c["subject"]) for c in report.cleaned] == [("light_job", silent.tag)]
    assert "the client is gone" in ledger.get(settings, silent.tag).error
    assert ledger.get(settings, talking.tag).state == "RUNNING"


def test_a_file_sinks_staging_left_by_an_ended_run_is_removed_after_the_grace(fleet: FakeFleet, settings: Settings,
                                                                              tmp_path: Path) -> None:
    sinks = {"totals": {"kind": "files", "path": str(tmp_path / "out"), "format": "parquet"}}
    dead, _ = _run(fleet, "clicks", state="KILLED", driver="KILLED", ended=True, sinks=sinks)
    live, _ = _run(fleet, "clicks", sinks=sinks)
    left = tmp_path / "out" / files.STAGING / f"run{dead}-batch7-0123456789ab"
    busy = tmp_path / "out" / files.STAGING / f"run{live}-batch8-ba9876543210"
    for folder in (left, busy):
        folder.mkdir(parents=True)
        (folder / "part-00000.parquet").write_bytes(b"PAR1")
    t0 = utcnow()
    assert _states(leaks.check(settings, fleet, GRACE, now=t0)) == {("sink_staging", f"clicks/{left.name}"): "waiting"}
    assert left.is_dir()
    report = leaks.check(settings, fleet, GRACE, now=t0 + timedelta(seconds=GRACE))
    assert [(c["kind"], c["subject"]) for c in report.cleaned] == [("sink_staging", f"clicks/{left.name}")]
    assert not left.exists() and busy.is_dir()  # the live run's write is its own


def test_nothing_registered_is_touched(settings: Settings, tmp_path: Path) -> None:
    fleet = FakeFleet(settings)
    fleet.up([("m1", VERSION), ("m2", VERSION)], light_jobs=True)
    sinks = {"totals": {"kind": "files", "path": str(tmp_path / "out"), "format": "parquet"}}
    running, driver = _run(fleet, "clicks", sinks=sinks)
    standby, standby_driver = _run(fleet, "clicks", state="STANDBY", current=False, standby_of=running)
    parked, parked_driver = _run(fleet, "views", state="PARKED")  # its driver holds its lease until a successor writes
    light = ledger.register(settings, "m1", VERSION, "sc://127.0.1.1:1", "s1", "alice", statement="SELECT 1",
                            block_shutdown=True, shutdown_timeout=30)
    with session_scope(settings.database_url) as s:
        s.add(Savepoint(job="clicks", name="done", mode="continue", status="COMPLETED",
                        path=str(settings.savepoint_dir / "clicks" / "done"), size_bytes=4, spark_version=VERSION,
                        stages={"totals": 1}))
    (settings.savepoint_dir / "clicks" / "done").mkdir(parents=True)
    writing = tmp_path / "out" / files.STAGING / f"run{running}-batch3-0123456789ab"
    writing.mkdir(parents=True)
    t0 = utcnow()
    for seconds in (0, GRACE, 10 * GRACE):
        report = leaks.check(settings, fleet, GRACE, now=t0 + timedelta(seconds=seconds))
        assert report.found == [] and report.refused == [] and report.gone == []
    assert fleet.master(VERSION).calls["kill"] == 0
    assert [fleet.driver(d).state for d in (driver, standby_driver, parked_driver)] == ["RUNNING"] * 3
    assert [_run_row(settings, r).state for r in (running, standby, parked)] == ["RUNNING", "STANDBY", "PARKED"]
    assert ledger.get(settings, light.tag).state == "RUNNING"
    assert sorted(fleet.connect_servers) == ["m1", "m2"]
    assert (settings.savepoint_dir / "clicks" / "done").is_dir() and writing.is_dir()
    assert _events(settings, "leak.found") == []


def test_an_application_nothing_of_ours_runs_is_reported_and_a_failed_cleanup_is_a_refusal(
        fleet: FakeFleet, settings: Settings) -> None:
    # m2 runs no Connect server; an application by its server's name, and somebody's shell, run on its master
    fleet.master(VERSION).apps.update({"app-x": "changeover-connect-m2", "app-y": "someones-shell"})
    t0 = utcnow()
    first = leaks.check(settings, fleet, GRACE, now=t0)
    assert _states(first) == {("app", f"{VERSION}/app-x"): "waiting", ("app", f"{VERSION}/app-y"): "reported"}
    later = leaks.check(settings, fleet, GRACE, now=t0 + timedelta(seconds=GRACE))
    assert _states(later) == {("app", f"{VERSION}/app-x"): "refused", ("app", f"{VERSION}/app-y"): "reported"}
    [refusal] = later.refused
    assert "end of application changeover-connect-m2 (app-x) on the Spark 4.2.0 master" in refusal
    assert "no process Changeover started runs it" in refusal and "master's web UI" in refusal
    assert fleet.master(VERSION).apps == {"app-x": "changeover-connect-m2", "app-y": "someones-shell"}
    assert _events(settings, "leak.cleaned") == []


def test_a_master_that_does_not_answer_neither_closes_nor_restarts_a_sighting(fleet: FakeFleet,
                                                                              settings: Settings) -> None:
    orphan = fleet.master(VERSION).create({"sparkProperties": {"spark.app.name": "changeover-gone"}})
    t0 = utcnow()
    leaks.check(settings, fleet, GRACE, now=t0)
    fleet.master(VERSION).unanswered.add("workload")
    mute = leaks.check(settings, fleet, GRACE, now=t0 + timedelta(seconds=GRACE))
    assert mute.unanswered == [VERSION] and mute.found == [] and mute.gone == []
    assert fleet.driver(orphan).state == "RUNNING" and _events(settings, "leak.gone") == []
    fleet.master(VERSION).unanswered.clear()
    back = leaks.check(settings, fleet, GRACE, now=t0 + timedelta(seconds=GRACE + 1))
    assert ("driver", f"{VERSION}/{orphan}") in {(c["kind"], c["subject"]) for c in back.cleaned}  # seen since t0
    assert fleet.driver(orphan).state == "KILLED"


def test_a_negative_grace_is_refused(fleet: FakeFleet, settings: Settings) -> None:
    from changeover.errors import ChangeoverError

    with pytest.raises(ChangeoverError, match="negative"):
        leaks.check(settings, fleet, -1)


def test_the_operator_checks_as_its_task_and_fails_on_a_refusal_after_the_rest(
        fleet: FakeFleet, settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow.sdk.exceptions import AirflowFailException
    from changeover_airflow import operators
    from changeover_airflow.leak_check import LeakCheckOperator

    monkeypatch.setenv("AIRFLOW_CONN_CHANGEOVER_DEFAULT", json.dumps(
        {"conn_type": "generic", "extra": {"home": str(settings.home), "database_url": settings.database_url}}))
    monkeypatch.setattr(operators.base, "membership_for", lambda _settings: fleet)  # where `_setup` looks it up
    pushed: dict[str, Any] = {}
    ti = SimpleNamespace(dag_id="leak_checker", run_id="r1", task_id="check", try_number=1,
                         xcom_push=lambda key, value: pushed.__setitem__(key, value))
    context = {"ti": ti, "params": {}, "dag_run": SimpleNamespace(triggering_user_name=None)}
    task = LeakCheckOperator(task_id="check", grace_seconds="0")  # rendered from the DAG's param

    orphan = fleet.master(VERSION).create({})
    result = contextvars.copy_context().run(task.execute, context)
    assert [(c["kind"], c["subject"]) for c in result["cleaned"]] == [("driver", f"{VERSION}/{orphan}")]
    with session_scope(settings.database_url) as s:
        actors = set(s.scalars(select(Event.actor).where(Event.action.like("leak.%"))))
    assert actors == {"scheduler via airflow:leak_checker/r1/check#1"}

    fleet.master(VERSION).apps["app-x"] = "changeover-connect-m2"
    stray = fleet.master(VERSION).create({})
    with pytest.raises(AirflowFailException, match="no process Changeover started runs it"):
        contextvars.copy_context().run(task.execute, context)
    assert fleet.driver(stray).state == "KILLED"  # the refusal held nothing else back
    assert [r.split(":")[0] for r in pushed["report"]["refused"]] == [f"app {VERSION}/app-x"]


def test_the_dag_runs_every_15_minutes_one_run_at_a_time_with_a_grace_param() -> None:
    from airflow.dag_processing.dagbag import DagBag
    from changeover_airflow.leak_check import LeakCheckOperator

    bag = DagBag(dag_folder=str(CHECKOUT / "dags" / "leak_checker.py"), safe_mode=False)
    assert bag.import_errors == {}
    dag = bag.dags["leak_checker"]
    assert dag.schedule == timedelta(minutes=15)
    assert (dag.catchup, dag.max_active_runs) == (False, 1)
    assert dag.params.get_param("grace_seconds").value == 600
    task = dag.get_task("check")
    assert isinstance(task, LeakCheckOperator) and task.grace_seconds == "{{ params.grace_seconds }}"


@pytest.mark.slow
@pytest.mark.parametrize("database_url", ONE_REGISTRY, indirect=True)  # a check of Spark, not of the registry
def test_a_real_driver_the_registry_lost_and_a_half_written_savepoint_are_cleaned_after_the_grace(
        settings: Settings, cluster: LocalCluster, tmp_path: Path) -> None:
    """On a real standalone cluster: a job's run ended in the registry (as a registry restored from an older backup
    would have it) while its driver runs on, and a savepoint whose builder died mid-copy. Within the grace both are
    only reported; after it, the driver is killed through its master and the staging removed."""
    cluster.up([("m1", VERSION)])
    generator = Generator(tmp_path / "landing")
    generator.write_file()
    try:
        jobs.submit(settings, cluster, "jobs.clicks", "forgotten",
                    options={"landing": str(generator.landing), "trigger": TRIGGER})
        run = jobs.wait_until_committed(settings, cluster, "forgotten")
        assert run.submission_id and drivers_of("forgotten", run.id)
        with session_scope(settings.database_url) as s:
            row = s.get(JobRun, run.id)
            row.state, row.ended_at = "KILLED", utcnow()
        staging = _half_written_savepoint(settings)
        driver = ("driver", f"{VERSION}/{run.submission_id}")
        t0 = utcnow()
        report = leaks.check(settings, cluster, GRACE, now=t0)
        assert _states(report)[driver] == "waiting" and report.cleaned == []
        assert drivers_of("forgotten", run.id) and staging.is_dir()
        report = leaks.check(settings, cluster, GRACE, now=t0 + timedelta(seconds=GRACE))
        assert {driver, ("savepoint_folder", "clicks/.staging-sp1")} <= {(c["kind"], c["subject"])
                                                                         for c in report.cleaned}
        assert not staging.exists()
        wait_for(lambda: not drivers_of("forgotten", run.id), 60, "the lost driver's process ending")
    finally:
        generator.stop()
