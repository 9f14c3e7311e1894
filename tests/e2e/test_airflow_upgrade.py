"""A rolling upgrade as users run it: triggered from the Airflow UI in a browser, run by the scheduler,
the LocalExecutor and the triggerer, on a real Spark cluster with a live stateful job.

Nothing is mocked. The forced failure arms a named fault point (`changeover.faults`) that SIGKILLs the
roll task's process after the job has stopped, as an OOM kill or a lost worker host would, and Airflow
retries it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from changeover import audit, faults, jobs, savepoints
from changeover.cli.generator import Generator
from changeover.cluster import LocalCluster, Membership, membership_for, processes, wait_for
from changeover.jobs import move_history
from changeover.registry.db import session_scope
from changeover.registry.models import JobRun, Savepoint, SinkLedger, utcnow
from changeover.registry.schema import migrate
from changeover.runtime import checkpoints, state_partitions
from changeover.settings import Settings
from changeover.timeutil import as_utc
from conftest import PG_ADMIN_URL, TRIGGER, feeding, start_clicks
from guide_words import GUIDE_JOB, Words, parquet_counts
from jobs import clicks
from platform_hosts import Platform, available
from sqlalchemy import create_engine, select, text

from e2e import browser
from e2e.conftest import REGISTRY_PASSWORD, Stack
from e2e.light_probe import SqlProbe, figures

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]
LEASE_SECONDS = 60
KILL_POINTS = ("drain.after_stop", "savepoint.copying.stop", "launch.submitted")
CONF = {"target_version": "4.3.0", "members": ["m1", "m2", "m3"], "shutdown_timeout": 30}


def _start_clicks(stack: Stack, name: str, lease: float = LEASE_SECONDS, wait: bool = True,
                  trigger: str = TRIGGER) -> Generator:
    generator = feeding(stack.settings.data_dir / f"landing-{name}")
    jobs.submit(stack.settings, stack.cluster, "jobs.clicks", name,
                options={"landing": str(generator.landing), "lease_seconds": lease, "trigger": trigger})
    if wait:
        jobs.wait_until_committed(stack.settings, stack.cluster, name)
    return generator


def _assert_exact(stack: Stack, name: str, generator: Generator) -> None:
    generator.stop()
    wait_for(lambda: clicks.results(stack.settings.database_url, name)[0] == dict(generator.truth), 300,
             f"job {name} catching up with every generated file")
    windows = clicks.results(stack.settings.database_url, name)[1]
    assert windows and all(generator.window_truth[k] == v for k, v in windows.items())


def _downtimes(stack: Stack, name: str) -> list[float]:
    """Seconds between a run's last commit and its successor's first commit, for each move."""
    return [move.downtime for move in move_history.of(stack.settings, name) if move.downtime is not None]


def _assert_rolled(stack: Stack, name: str) -> None:
    """Every member at 4.3.0, and the job on it after one move: members without jobs were drained first."""
    status = stack.cluster.status()
    assert {(m["name"], m["version"], m["status"]) for m in status["members"]} == {
        ("m1", "4.3.0", "ACTIVE"), ("m2", "4.3.0", "ACTIVE"), ("m3", "4.3.0", "ACTIVE")}
    run = jobs.refresh(stack.settings, stack.cluster, name)
    assert run is not None and run.spark_version == "4.3.0" and run.state in jobs.LIVE
    made = move_history.of(stack.settings, name)
    assert [(m.from_version, m.to_version) for m in made] == [("4.2.0", "4.3.0")], made


def _start_guide(settings: Settings, cluster: Membership) -> tuple[Words, Path]:
    """The guide's windowed count, from a file outside the checkout, writing parquet: a user's own job."""
    outside = settings.home.parent / "team-repo" / GUIDE_JOB.name
    outside.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(GUIDE_JOB, outside)
    words, output = Words(settings.home.parent / "words"), settings.home.parent / "guide-output"
    for _ in range(24):
        words.write()
    jobs.submit(settings, cluster, str(outside), "guide",
                options={"words": str(words.folder), "output": str(output), "lease_seconds": LEASE_SECONDS})
    jobs.wait_until_committed(settings, cluster, "guide")
    return words, output


@pytest.mark.only_on("postgresql" if PG_ADMIN_URL else "sqlite",
                     "run once, on PostgreSQL metadata (CI); the other SQLite tests drive Airflow's upgrades")
def test_ui_triggered_rolling_upgrade_is_exact_and_audited(stack: Stack, members: list[str]) -> None:
    """On PostgreSQL metadata the roll task is also killed mid-drain, mid-savepoint and mid-launch; on SQLite a
    user's own job, the guide's windowed count writing parquet, is rolled beside the demo's job. It runs once,
    on PostgreSQL when CI sets it: SQLite metadata runs update_job's upgrades through the same scheduler (and, under
    make test-e2e, the zero-downtime roll), and tests/test_user_jobs.py moves the guide's job exact."""
    forced = stack.kind == "postgresql"
    # three killed tries in a row take longer than the usual lease: the parked run waits them out
    lease = 3 * LEASE_SECONDS if forced else LEASE_SECONDS
    generator = _start_clicks(stack, "clicks", lease, wait=False)
    # Light SQL through the upgrade (seed 000): a Connect server per member, and a client asking once a second.
    # Each member's own server, started side by side (its master and worker are up: each start writes only its own
    # member's row) while the job plans its first batch, with twice the usual start timeout, as their JVMs and the
    # job's share two cores.
    patient = LocalCluster(stack.settings, start_timeout=2 * stack.cluster.start_timeout)
    with ThreadPoolExecutor(len(members)) as pool:
        list(pool.map(lambda member: patient.start_worker(member, "4.2.0", light_jobs=True), members))
    jobs.wait_until_committed(stack.settings, stack.cluster, "clicks")
    guide = _start_guide(stack.settings, stack.cluster) if stack.kind == "sqlite" else None
    probe = SqlProbe(stack.settings).start()
    wait_for(lambda: len([a for a in probe.answers if a.ok]) >= 3, 120, "the Connect servers' first answers")
    warm = time.time()  # the baseline leaves out the first queries, which wait for the servers' executors
    wait_for(lambda: len(probe.between(warm, time.time())) >= 15, 120, "15 light queries before the upgrade")
    quiet_until = time.time()
    if forced:  # the roll task's process SIGKILLed mid-drain, mid-savepoint and mid-launch, one try each
        for point in KILL_POINTS:
            faults.arm(stack.settings, point, kill=True)
    try:
        artifacts = stack.artifacts("ui-upgrade")
        airflow = stack.airflow
        airflow.wait_for_dag("rolling_upgrade")
        # The replay before a drain is test_compat_matrix's, and through Airflow the update_job test's.
        conf = {**CONF, "replay_check": False, "require_approval": True}
        run_id = browser.trigger_from_ui(airflow.url, "admin", airflow.password, "rolling_upgrade", conf, artifacts)
        _answer_approval(stack, "rolling_upgrade", run_id, "Approve", artifacts)  # the plan, shown to a person
        if forced:  # the registry's password, where a deferred task, its trigger and the drivers would show it
            wait_for(lambda: _states(stack, "rolling_upgrade", run_id).get("roll") == "deferred", 600,
                     "the roll task deferring to its trigger")
            assert not _leaks(stack, REGISTRY_PASSWORD), _leaks(stack, REGISTRY_PASSWORD)
            _a_cli_drain_racing_the_roll_is_refused(stack)
        state = airflow.follow("rolling_upgrade", run_id, timeout=1800)
        upgraded_at = time.time()
        browser.screenshot_grid(airflow.url, "admin", airflow.password, "rolling_upgrade", run_id,
                                artifacts / "grid.png")
        assert state == "success", _task_log_tail(stack, run_id)
    finally:
        generator.stop()
        probe.stop()
    _assert_sql_stayed_available(probe, warm, quiet_until, upgraded_at, artifacts)
    _the_changeover_view_shows_the_upgrade(stack, run_id, artifacts)
    _light_sql_and_the_leak_checker_run_through_the_scheduler(stack, since=upgraded_at)
    _assert_rolled(stack, "clicks")
    _assert_exact(stack, "clicks", generator)
    if guide is not None:  # windows open before the upgrade close after it: their state came across
        words, output = guide
        _assert_rolled(stack, "guide")
        for _ in range(12):
            words.write()
        words.flush()
        wait_for(lambda: parquet_counts(output) == words.truth(), 300, "every closed window of the guide job")
    if forced:
        assert not _leaks(stack, REGISTRY_PASSWORD), _leaks(stack, REGISTRY_PASSWORD)
        roll = next(t for t in airflow.task_instances("rolling_upgrade", run_id) if t["task_id"] == "roll")
        assert roll["try_number"] >= 1 + len(KILL_POINTS)  # each kill cost a try; each retry went on from there
        # in the order the path reaches them: a warm move launches its standby before anything stops
        assert sorted(line.split(" pid ")[0] for line in faults.fired(stack.settings)) == sorted(
            f"{point} kill" for point in KILL_POINTS)
        # The launch's answer died with its task: the driver named its submission itself, so it is observed.
        reconciled = [e for e in audit.find(stack.settings.database_url, job="clicks")
                      if e.action == "job.submission_reconciled"]
        assert len(reconciled) == 1, reconciled
        # The job was down at most for the lease plus one restart, though its move's try failed.
        assert max(_downtimes(stack, "clicks")) < lease + 90

    # The person who pressed Trigger is in the run, in every action's audit row and in the task logs.
    dag_run = airflow.run("rolling_upgrade", run_id)
    assert dag_run["triggering_user_name"] == "admin"
    assert dag_run["conf"]["members"] == CONF["members"]
    actions = audit.find(stack.settings.database_url, upgrade=f"rolling_upgrade/{run_id}", limit=10_000)
    by_action = {e.action for e in actions}
    # job.launch.begin: the launch's second half (job.launch) may die with a killed try; the driver reconciles it
    assert {"upgrade.begin", "drain.begin", "job.request_stop", "savepoint.create", "job.launch.begin",
            "member.upgrade", "upgrade.member.upgraded", "upgrade.end"} <= by_action
    task_actors = {e.actor for e in actions if e.actor.startswith("admin via airflow:rolling_upgrade/")}
    assert {a.split("/")[2].split("#")[0] for a in task_actors} >= {"preflight", "roll", "verify"}
    logged = [json.loads(e.removeprefix("audit ")) for e in _task_log_events(stack, run_id) if e.startswith("audit {")]
    assert {e["action"] for e in logged} >= {"drain.begin", "savepoint.create", "member.upgrade", "upgrade.end"}
    assert all(e["actor"].startswith("admin via airflow:rolling_upgrade/") for e in logged)
    # Airflow's own audit log shows who triggered it.
    triggered = [e for e in airflow.event_logs(dag_id="rolling_upgrade")
                 if e.get("run_id") == run_id or "trigger" in (e.get("event") or "")]
    assert any(e.get("owner") == "admin" for e in triggered), triggered


def _answer_approval(stack: Stack, dag_id: str, run_id: str, option: str, artifacts: Path) -> None:
    """Answer the run's approval in the UI once it asks, as a person does, and wait until the task has taken the
    answer. Where Airflow 3.3 fails the try it resumed with the answer (the asking try's late exit report), the retry
    takes the same answer when it kept the task instance's id (tests/test_approval_retries.py). In the race's other
    variant, still open in 3.3, the resumed try was already running: the retry is a new task instance, whose
    question is new and whose old answer is in Airflow's history, out of a task's reach. It asks again, and is
    answered again with the same option, as a person sees the question again under Required Actions."""
    stack.airflow.await_question(dag_id, run_id, "approval")
    answered: set[int] = set()

    def taken() -> bool:
        ti = next(t for t in stack.airflow.task_instances(dag_id, run_id) if t["task_id"] == "approval")
        assert ti["state"] not in ("failed", "upstream_failed"), _task_log_tail(stack, run_id, dag_id)
        if ti["state"] in ("awaiting_input", "deferred") and ti["try_number"] not in answered:
            answered.add(ti["try_number"])
            if len(answered) > 1:
                print(f"the approval of run {run_id} asked again in try {ti['try_number']}: answered {option} again")
            browser.answer_in_ui(stack.airflow.url, "admin", stack.airflow.password, dag_id, run_id, "approval",
                                 option, artifacts)
        return ti["state"] == "success"

    wait_for(taken, 300, f"the approval of run {run_id} taking the answer {option}")


def _the_changeover_view_shows_the_upgrade(stack: Stack, run_id: str, artifacts: Path) -> None:
    """The approval is on record with its approver; the Changeover view (the plugin's pages on the api-server) shows
    the fleet at its new version and the job's move, and the run's timeline each member's phases."""
    airflow, key = stack.airflow, f"rolling_upgrade/{run_id}"
    approvals = [(e.outcome, e.details["approver"]) for e in audit.find(stack.settings.database_url, upgrade=key,
                                                                        limit=10_000) if e.action == "upgrade.approval"]
    assert approvals and set(approvals) == {("approved", "admin")}, approvals  # once per try that asked
    overview = browser.screenshot_view(airflow.url, "admin", airflow.password, "/changeover/", "Fleet",
                                       artifacts / "changeover-view.png")
    assert "clicks" in overview and "4.3.0" in overview and key in overview
    timeline = browser.screenshot_view(airflow.url, "admin", airflow.password, f"/changeover/upgrades/{key}",
                                       f"Upgrade {key}", artifacts / "changeover-timeline.png")
    assert all(f"member {m}" in timeline for m in CONF["members"]) and "clicks" in timeline


def _assert_sql_stayed_available(probe: SqlProbe, warm: float, quiet_until: float, upgraded_at: float,
                                 artifacts: Path) -> None:
    """At least 99% of the light queries during the upgrade succeeded, and each answer came from one version: the
    group it was routed to. The figures, beside the same before the upgrade, go to the test's artifacts."""
    quiet, during = probe.between(warm, quiet_until), probe.between(quiet_until, upgraded_at)
    report = {"no_upgrade": figures(quiet), "during_upgrade": figures(during)}
    (artifacts / "light-sql.json").write_text(json.dumps(report, indent=2))
    print("light SQL through the upgrade:", json.dumps(report))
    assert len(during) >= 30 and report["during_upgrade"]["success_rate"] >= 0.99, report
    assert all(a.answered == a.routed for a in during if a.ok), [a for a in during if a.answered != a.routed]
    assert {a.routed for a in during if a.ok} == {"4.2.0", "4.3.0"}, report  # routed to each group in turn


def _light_sql_and_the_leak_checker_run_through_the_scheduler(stack: Stack, since: float) -> None:
    """The light_sql DAG's LightJobOperator, routed to the group the upgrade left, and a leak_checker run, which
    finds nothing to clean in the fleet just rolled (and would clean nothing within its grace)."""
    airflow = stack.airflow
    asked = airflow.trigger("light_sql", {"sql": "SELECT 6 * 7 AS answer"})
    assert airflow.follow("light_sql", asked, timeout=300) == "success", _task_log_tail(stack, asked, "light_sql")
    started = [e for e in audit.find(stack.settings.database_url, since=datetime.fromtimestamp(since, UTC), limit=500)
               if e.action == "light.start" and e.actor.startswith(f"admin via airflow:light_sql/{asked}/sql#")]
    assert [e.details["version"] for e in started] == ["4.3.0"], started
    try:
        checked = airflow.trigger("leak_checker", {"grace_seconds": 600})
        assert airflow.follow("leak_checker", checked, timeout=300) == "success", \
            _task_log_tail(stack, checked, "leak_checker")
    finally:  # its 15-minute schedule is not the tests'
        airflow.api("PATCH", "/dags/leak_checker", json={"is_paused": True}).raise_for_status()
    said = "\n".join(_task_log_events(stack, checked, "leak_checker"))
    # The roll left no run, driver, application or light job unaccounted for; a killed try's savepoint leftovers
    # may be reported (cleaned after the grace, which this first look starts).
    kinds = re.findall(r"leak (\w+) ", said)
    assert re.search(r"leak check: \d+ found, 0 cleaned", said) and set(kinds) <= {
        "savepoint", "savepoint_folder", "pidfile", "sink_staging"}, said[-2000:]


def _a_cli_drain_racing_the_roll_is_refused(stack: Stack) -> None:
    """While the DAG drains one member, a person drains another from the CLI, through the same registry on
    PostgreSQL: refused, naming the member being drained, and nothing changes. (Two drains beginning at the
    very same moment are settled by the member rows' lock: tests/test_control_plane_registry.py.)"""
    status = {m["name"]: m["status"] for m in stack.cluster.status()["members"]}
    draining = [m for m, s in status.items() if s in ("DRAINING", "DRAINED", "UPGRADING")]
    idle = [m for m, s in status.items() if s == "ACTIVE" and m not in draining]
    assert draining and idle, status
    env = {**os.environ, **stack.settings.as_env(), "COLUMNS": "200"}
    env.pop("CHANGEOVER_DATABASE_URL", None)
    refused = subprocess.run([str(Path(sys.executable).parent / "changeover"), "drain", idle[0]], env=env,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0
    said = " ".join((refused.stdout + refused.stderr).split())
    named = re.search(rf"drain of member {idle[0]}: member (\S+) is being drained or upgraded", said)
    assert named and named.group(1) in status and named.group(1) != idle[0], said
    assert next(m["status"] for m in stack.cluster.status()["members"] if m["name"] == idle[0]) == "ACTIVE"


def _leaks(stack: Stack, secret: str) -> list[str]:
    """Where `secret` shows: Airflow's logs (tasks, triggers, scheduler), every row of its metadata database
    (trigger rows, task instances' next_kwargs, XComs, rendered fields) and of the registry (runs' sink
    descriptions, events), every JSON file under Changeover's home but its secrets (savepoint manifests), and the
    environment of every process Airflow and the Spark cluster run (drivers included)."""
    found = [str(p) for p in [*stack.airflow.logs, *stack.airflow.home.rglob("*.log")]
             if p.is_file() and secret in p.read_text(errors="replace")]
    found += [str(p) for p in stack.settings.home.rglob("*.json") if "secrets" not in p.parts
              and p.is_file() and secret in p.read_text(errors="replace")]
    for name, url in (("metadata", stack.airflow.env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]),
                      ("registry", stack.settings.database_url)):
        database = create_engine(url)
        with database.connect() as conn:
            tables = conn.scalars(text("SELECT table_name FROM information_schema.tables "
                                       "WHERE table_schema = 'public'"))
            for table in list(tables):
                if conn.scalar(text(f'SELECT count(*) FROM "{table}" t WHERE t::text LIKE :s'),
                               {"s": f"%{secret}%"}):
                    found.append(f"{name} table {table}")
        database.dispose()
    groups = [stack.airflow.started.pid] if stack.airflow.started else []
    groups += [int(p.read_text().split()[0]) for p in stack.cluster.pid_dir.glob("*.pid")]
    for pid in (pid for group in groups for pid in processes.group_members(group)):
        try:
            if secret in Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace"):
                found.append(f"environment of process {pid} ({Path(f'/proc/{pid}/cmdline').read_text()[:80]})")
        except OSError:
            continue  # ended meanwhile
    return found


def test_every_dag_parses_in_the_dag_processor_with_its_schedule(stack: Stack) -> None:
    airflow = stack.airflow
    for dag_id in ("rolling_upgrade", "update_job", "drain_window", "savepoint_maintenance", "deferral_race",
                   "light_sql", "leak_checker"):
        airflow.wait_for_dag(dag_id)
    assert airflow.api("GET", "/importErrors").json()["total_entries"] == 0
    window = airflow.api("GET", "/dags/drain_window/details").json()
    assert window["timetable_summary"] == "drain window SUN 02:00-04:00 UTC", window["timetable_summary"]


def test_invalid_param_is_refused_with_airflows_message(stack: Stack) -> None:
    airflow = stack.airflow
    airflow.wait_for_dag("rolling_upgrade")
    before = airflow.api("GET", "/dags/rolling_upgrade/dagRuns").json()["total_entries"]
    shown = browser.submit_invalid(airflow.url, "admin", airflow.password, "rolling_upgrade",
                                   {**CONF, "shutdown_timeout": -5}, stack.artifacts("invalid-param"))
    assert "Invalid input for param shutdown_timeout: -5 is less than the minimum of 0" in shown
    assert airflow.api("GET", "/dags/rolling_upgrade/dagRuns").json()["total_entries"] == before


def _task_logs(stack: Stack, run_id: str, dag_id: str = "rolling_upgrade") -> list[Path]:
    """The tasks' own logs (attempt=N.log), not their triggers' (attempt=N.log.trigger.M.log)."""
    folder = stack.airflow.home / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}"
    return sorted(p for p in folder.rglob("attempt=*.log") if ".trigger." not in p.name)


def _task_log_events(stack: Stack, run_id: str, dag_id: str = "rolling_upgrade") -> list[str]:
    events = []
    for path in _task_logs(stack, run_id, dag_id):
        for line in path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
                events.append(str(record.get("event")) + str(record.get("error_detail", "")))
            except json.JSONDecodeError:
                events.append(line)
    return events


def _task_log_tail(stack: Stack, run_id: str, dag_id: str = "rolling_upgrade") -> str:
    lines = []
    for path in _task_logs(stack, run_id, dag_id):
        for line in path.read_text(errors="replace").splitlines()[-15:]:
            try:
                lines.append(f"{path.parent.name}/{path.name}: {json.loads(line).get('event')}")
            except json.JSONDecodeError:
                lines.append(line)
    return "\n".join(lines[-120:])


# 133 s, mostly its 45 s lease, waited out. CI keeps its parts: a parked run resumes once its lease runs out, with no
# orchestrator, without Spark on both registries (test_leases_and_fencing, test_lease_decisions); a real parked driver
# takes its job back (test_user_jobs); a roll task killed mid-drain, mid-savepoint and mid-launch goes on at its retry
# through the scheduler (the UI upgrade above).
@pytest.mark.long
@pytest.mark.only_on("sqlite", "run once, on the embedded default; the PostgreSQL run has the forced failure")
def test_a_killed_scheduler_leaves_no_job_stopped_and_a_restart_finishes_the_run(
    stack: Stack, members: list[str]
) -> None:
    # the outage outlasts the lease, so the test waits it out: 45 s, not the usual minute. The cold move after the
    # restart must have its successor's session up within it (the grace counts from a heartbeat): 15-20 s here,
    # about twice that on a slow day
    lease = 45
    generator = _start_clicks(stack, "clicks_outage", lease)
    airflow = stack.airflow
    try:
        first = jobs.refresh(stack.settings, stack.cluster, "clicks_outage")
        assert first is not None and first.member is not None
        # Only the job's member is rolled: the outage is the point, and one member is enough to park the job.
        # The replay before the drain is the UI test's; here the outage during the move is the point.
        run_id = airflow.trigger("rolling_upgrade", {**CONF, "members": [first.member], "replay_check": False})
        wait_for(lambda: _parked(stack, "clicks_outage"), 600, "the job parking for its move")
        killed = airflow.kill_component("scheduler")
        assert killed, "no scheduler process was found in Airflow's process group"
        parked_at = utcnow()
        wait_for(lambda: _running_again(stack, "clicks_outage"), lease + 90,
                 "the stopped job running again without a scheduler")
        back_after = (utcnow() - parked_at).total_seconds()
        assert back_after < lease + 90
        why = [e.details["reason"] for e in audit.find(stack.settings.database_url, job="clicks_outage")
               if e.action == "job.unpark"]
        assert why == ["its lease ran out and no successor was launched"], why
        airflow.restart_component("scheduler")  # as its service manager would; the other components ran on
        state = airflow.follow("rolling_upgrade", run_id, timeout=1500)
        assert state == "success", _task_log_tail(stack, run_id)
    finally:
        generator.stop()
    assert {(m["name"], m["version"]) for m in stack.cluster.status()["members"] if m["name"] in members} == {
        (first.member, "4.3.0"), *((m, "4.2.0") for m in members if m != first.member)}
    run = jobs.refresh(stack.settings, stack.cluster, "clicks_outage")
    assert run is not None and run.state in jobs.LIVE and run.member != first.member
    _assert_exact(stack, "clicks_outage", generator)


# 2 min. make test keeps the roll's own strategy path without Spark, on both registries: the move_strategy Param
# rendered into the roll task, through roll and drain to each move, a follower for zero_downtime and none for warm
# (test_move_paths.py's test_the_rolling_upgrades_move_strategy_param_reaches_the_moves_of_its_drains); and a
# zero-downtime move through the scheduler in update_job's case
# (test_incompatible_changes_stop_at_their_check_and_update_job_updates_or_rolls_back)
@pytest.mark.long
@pytest.mark.only_on("sqlite", "run once, on the embedded default; the PostgreSQL run has the forced failures")
def test_a_zero_downtime_roll_through_the_scheduler_moves_the_job_once_through_its_follower_exact(
    stack: Stack, members: list[str]
) -> None:
    """Issue 27 as users run it: `rolling_upgrade` with move_strategy zero_downtime, triggered through Airflow's REST
    API as the UI does, run by the scheduler, the executor and the triggerer. The job's follower on 4.3.0 catches up
    read-only while the roll's trigger waits, then takes over; one move, exact, its downtime and freshness in the
    verify task's summary and in the events. No input file waits for the sink across the move more than a trigger
    interval longer than the old run's files usually waited (`_assert_fresh_through_the_move`). The trigger is 5 s:
    on 2 cores beside Airflow, three workers and the follower, a batch of `clicks` takes 1.5-2.2 s, so at the demo's
    1 s a file waits longer than two intervals with no move at all."""
    trigger_seconds = 5.0
    generator = _start_clicks(stack, "clicks_zd", trigger=f"{trigger_seconds:.0f} seconds")
    airflow = stack.airflow
    try:
        run_id = airflow.trigger("rolling_upgrade", {**CONF, "replay_check": False, "move_strategy": "zero_downtime"})
        state = airflow.follow("rolling_upgrade", run_id, timeout=1800)
        assert state == "success", _task_log_tail(stack, run_id)
    finally:
        generator.stop()
    _assert_rolled(stack, "clicks_zd")
    made = move_history.of(stack.settings, "clicks_zd")
    assert [m.kind for m in made] == ["zero-downtime"], made
    recorded = [e.details for e in audit.find(stack.settings.database_url, job="clicks_zd")
                if e.action == "job.move.freshness"]
    assert [(e["move"], e["to_run"]) for e in recorded] == [("zero-downtime", made[0].to_run)], recorded
    gap, down = recorded[0]["largest_gap_seconds"], recorded[0]["downtime_seconds"]
    # a file the follower's first batch read waited about as long as the job was down, give or take a trigger and
    # the registry's clock against the checkpoints' (2 s)
    assert gap is not None and down is not None and gap >= down - 2.0, recorded
    _assert_fresh_through_the_move(recorded[0], trigger_seconds)
    levels = [(e.details["at"], e.details["how"]) for e in audit.find(stack.settings.database_url, job="clicks_zd")
              if e.action == "job.follow.level" and e.details["run"] == made[0].to_run]
    assert levels, "the follower that took over never recorded where it was level"
    print("zero-downtime roll:", made[0].describe(), "; its follower level:", levels)
    _assert_exact(stack, "clicks_zd", generator)
    parked = next(e.details for e in audit.find(stack.settings.database_url, job="clicks_zd") if e.action == "job.park")
    with session_scope(stack.settings.database_url) as s:
        at_cut_over = s.scalar(select(Savepoint).where(Savepoint.job == "clicks_zd", Savepoint.mode == "stop"))
    assert (at_cut_over is not None and at_cut_over.status == "COMPLETED"
            and at_cut_over.stages == parked["progress"]), at_cut_over
    _assert_ledger_split(stack, "clicks_zd", parked["progress"], made[0].from_run, made[0].to_run)


def _assert_fresh_through_the_move(figures: dict[str, Any], trigger_seconds: float) -> None:
    """Issue 27's freshness, against the job's own baseline: no input file waited for the sink through the move more
    than one trigger interval longer than the old run's files usually waited (its batches' median largest wait, from
    its checkpoint, over its last batches before the move). Issue 27's own bound, two intervals, is below what a file
    waits with no move at all on this machine when loaded (docs/zero-downtime.md); the baseline carries that load."""
    gap, usual = figures.get("largest_gap_seconds"), figures.get("usual_gap_seconds")
    # both measured, neither missing nor "not measured: ..."
    assert isinstance(gap, int | float) and isinstance(usual, int | float), figures
    assert gap <= usual + trigger_seconds, figures


def _assert_ledger_split(stack: Stack, name: str, parked_at: dict[str, int], old: int, new: int) -> None:
    """Each stage's batches in its keyed table's ledger (one row a batch: its key): the old run's writer up to the
    batch it parked on, the follower's after it, and nothing else."""
    with session_scope(stack.settings.database_url) as s:
        ledger = [(row.stage, row.batch_id, row.run_id) for row in s.scalars(
            select(SinkLedger).where(SinkLedger.job == name))]
    for stage, at in parked_at.items():
        writers = {b: w for st, b, w in ledger if st == stage}
        before, after = {writers[b] for b in writers if b <= at}, {writers[b] for b in writers if b > at}
        assert before == {old} and after == {new}, (stage, at, writers)


def _parked(stack: Stack, name: str) -> bool:
    run = jobs.refresh(stack.settings, stack.cluster, name)
    return run is not None and run.parked


def _running_again(stack: Stack, name: str) -> bool:
    """The job's current run is live and has committed a batch since the stop."""
    run = jobs.refresh(stack.settings, stack.cluster, name)
    if run is None or run.state not in jobs.LIVE:
        return False
    with session_scope(stack.settings.database_url) as s:
        parks = [e.at for e in audit.find(stack.settings.database_url, job=name) if e.action == "job.park"]
        current = s.get(JobRun, run.id)
        return bool(parks) and current is not None and current.last_commit_at is not None \
            and as_utc(current.last_commit_at) > as_utc(parks[-1])


@pytest.mark.long  # its fix is checked in tests/test_processes.py; the reproduction takes two minutes of Airflow
@pytest.mark.only_on("sqlite", "the race is the scheduler's, whatever its database: run once")
def test_the_deferral_race_is_reproduced_and_both_fixes_avoid_it(stack: Stack) -> None:
    airflow = stack.airflow
    run_id = airflow.trigger("deferral_race", {})
    assert airflow.follow("deferral_race", run_id, timeout=600) == "failed"
    states = {t["task_id"]: (t["state"], t["try_number"]) for t in airflow.task_instances("deferral_race", run_id)}
    assert states == {"race": ("failed", 1), "settled": ("success", 1)}, states
    scheduler_log = "\n".join(log.read_text(errors="replace") for log in airflow.logs)  # a restarted one's too
    assert "reported that the task instance <TaskInstance: deferral_race.race" in scheduler_log
    assert "reported that the task instance <TaskInstance: deferral_race.settled" not in scheduler_log


CLICKS_SOURCE = Path(clicks.__file__).read_text()
AGGREGATE = '    totals = events.groupBy("key").count()\n'
# Versions of the demo's job as a team would edit them, each a file of its own outside the checkout.
EDITS = {
    # made incompatible with Spark 4.2.1 on purpose: there it sums where the state holds counts
    "clicks_v1": AGGREGATE.replace("    totals = ", '    totals = events.groupBy("key").agg(F.sum("seq").alias('
                                   '"count")) if spark.version == "4.2.1" else '),
    "clicks_filtered": '    events = events.where(F.col("key").isNotNull())\n' + AGGREGATE,
    "clicks_summed": '    totals = events.groupBy("key").agg(F.sum("seq").alias("count"))\n',
    "clicks_poisoned": '    events = events.where(F.when(F.col("key") == "poison", F.raise_error(F.lit("poisoned '
                       'event"))).isNull())\n' + AGGREGATE,
}


def _edit(folder: Path, name: str) -> str:
    assert AGGREGATE in CLICKS_SOURCE
    path = folder / f"{name}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(CLICKS_SOURCE.replace(AGGREGATE, EDITS[name]))
    return str(path)


def _states(stack: Stack, dag_id: str, run_id: str) -> dict[str, str]:
    return {t["task_id"]: t["state"] for t in stack.airflow.task_instances(dag_id, run_id)}


def _committing_on(stack: Stack, name: str, run_id: int) -> None:
    """The job's run is still `run_id`, and it commits a batch after now."""
    with session_scope(stack.settings.database_url) as s:
        since = s.get(JobRun, run_id).last_commit_at
    wait_for(lambda: (r := jobs.refresh(stack.settings, stack.cluster, name)) is not None and r.id == run_id
             and r.state == "RUNNING" and r.last_commit_at is not None and r.last_commit_at != since, 120,
             f"run {run_id} of job {name} committing again")


@pytest.mark.only_on("sqlite", "the checks and the update run once, on the embedded default")
def test_incompatible_changes_stop_at_their_check_and_update_job_updates_or_rolls_back(stack: Stack) -> None:
    """One member at 4.2.0 and one job on the demo's data, its code edited in files outside the checkout:
    - rolling_upgrade to 4.2.1, where the job's code sums instead of counting, stops in its compatibility
      check: no member drained, the job running on;
    - update_job with count -> sum stops at its check, the job untouched;
    - update_job with a filter added completes, zero-downtime: a follower on the new code catches up read-only
      and takes over from the next batch, the job never stopped before;
    - update_job with code that fails on a later batch, zero-downtime too, is rolled back to the code before it
      from the savepoint of its cut-over.
    The sinks then hold exactly the ground truth."""
    name, airflow = "clicks_update", stack.airflow
    edits = stack.settings.home.parent / "team-repo"
    stack.cluster.up([("u1", "4.2.0")])
    generator = Generator(stack.settings.data_dir / f"landing-{name}")
    try:
        generator.write_file()
        generator.start(interval=0.5)
        # a 5 s trigger: on 2 cores beside Airflow a batch of this job takes 2-3 s, and its zero-downtime update's
        # follower, replaying each batch as a new query on the same cores, needs that headroom to catch up
        jobs.submit(stack.settings, stack.cluster, _edit(edits, "clicks_v1"), name,
                    options={"landing": str(generator.landing), "lease_seconds": LEASE_SECONDS,
                             "trigger": "5 seconds"})
        first = jobs.wait_until_committed(stack.settings, stack.cluster, name)

        # An upgrade that asks for approval shows its plan and waits; rejected, it ends with nothing drained.
        asked = airflow.trigger("rolling_upgrade", {**CONF, "members": ["u1"], "replay_check": False,
                                                    "require_approval": True})
        _answer_approval(stack, "rolling_upgrade", asked, "Reject", stack.artifacts("rejected-upgrade"))
        # Queued behind it (one run of the DAG at a time): the replay before the drain is test_compat_matrix's; the
        # static check stops this one (CO-AGG-01).
        upgrade = airflow.trigger("rolling_upgrade", {**CONF, "target_version": "4.2.1", "members": ["u1"],
                                                      "replay_check": False})
        # Beside them, as two teams' runs would be (neither touches the job): the static check refuses this update;
        # the dry run's confirmation is the rolling upgrade's.
        refused = airflow.trigger("update_job", {"job": name, "code": _edit(edits, "clicks_summed"),
                                                 "dry_run": False})
        assert airflow.follow("rolling_upgrade", asked, timeout=600) == "success"
        assert _states(stack, "rolling_upgrade", asked) == {
            "preflight": "success", "compatibility": "success", "approval": "success", "roll": "skipped",
            "rebalance": "skipped", "verify": "skipped", "finish": "success"}
        assert "job clicks_update: RUNNING on u1 at 4.2.0" in "\n".join(_task_log_events(stack, asked))
        key = f"rolling_upgrade/{asked}"
        trail = [(e.action, e.outcome, e.details.get("approver")) for e in audit.find(stack.settings.database_url,
                                                                                        upgrade=key)]
        assert ("upgrade.approval", "rejected", "admin") in trail and ("upgrade.end", "rejected", None) in trail
        assert not [action for action, _, _ in trail if action.startswith(("drain.", "job.request_stop"))]
        assert [(m["name"], m["version"], m["status"]) for m in stack.cluster.status()["members"]
                if m["name"] == "u1"] == [("u1", "4.2.0", "ACTIVE")]  # other tests' members may be on record
        _committing_on(stack, name, first.id)
        # The Changeover view is Airflow's: nobody signed in sees nothing of it. Its tasks link to it.
        assert httpx.get(f"{airflow.url}/changeover/api/fleet", timeout=30).status_code in (401, 403)
        links = airflow.api("GET", f"/dags/rolling_upgrade/dagRuns/{asked}/taskInstances/preflight/links").json()
        assert links["extra_links"] == {"Changeover": f"/changeover/upgrades/rolling_upgrade/{asked}",
                         "Spark master": f"/changeover/master-of/rolling_upgrade/{asked}"}, links

        assert airflow.follow("rolling_upgrade", upgrade, timeout=900) == "failed"
        assert _states(stack, "rolling_upgrade", upgrade) == {
            "preflight": "success", "compatibility": "failed", "approval": "upstream_failed", "roll": "upstream_failed",
            "rebalance": "upstream_failed", "verify": "upstream_failed", "finish": "failed"}
        logged = "\n".join(_task_log_events(stack, upgrade))
        assert "CO-AGG-01 job clicks_update, stage totals" in logged, logged[-3000:]
        assert not [e for e in audit.find(stack.settings.database_url, upgrade=f"rolling_upgrade/{upgrade}")
                    if e.action == "drain.begin"]
        assert [(m["name"], m["version"], m["status"]) for m in stack.cluster.status()["members"]
                if m["name"] == "u1"] == [
            ("u1", "4.2.0", "ACTIVE")]
        _committing_on(stack, name, first.id)

        assert airflow.follow("update_job", refused, timeout=900) == "failed"
        assert _states(stack, "update_job", refused)["check"] == "failed"
        assert _states(stack, "update_job", refused)["stop"] == "upstream_failed"
        said = "\n".join(_task_log_events(stack, refused, "update_job"))
        assert "[INCOMPATIBLE] CO-AGG-01 job clicks_update, stage totals" in said and "Fix: " in said
        _committing_on(stack, name, first.id)

        # The dry run's replay of a compatible change is checked in tests/test_compat_matrix.py; here, the update,
        # zero-downtime: the old code runs on until the follower on the new code has caught up.
        updated = airflow.trigger("update_job", {"job": name, "code": _edit(edits, "clicks_filtered"),
                                                 "dry_run": False, "strategy": "zero_downtime",
                                                 "stable_batches": 2})
        assert airflow.follow("update_job", updated, timeout=900) == "success", \
            _task_log_tail(stack, updated, "update_job")
        run = jobs.refresh(stack.settings, stack.cluster, name)
        assert run is not None and run.state == "RUNNING" and run.id != first.id
        assert run.standby_of == first.id and run.following_since is not None  # the follower took it over
        with session_scope(stack.settings.database_url) as s:
            assert Path(jobs.get_job(s, name).code or "").name == "clicks_filtered.py"
        trail = [e.action for e in audit.find(stack.settings.database_url, job=name)
                 if e.action in ("job.follow.start", "job.follow.caught_up", "job.request_stop", "job.hand_over",
                                 "job.update_code") and as_utc(e.at) >= as_utc(first.submitted_at)]
        assert trail[-5:] == ["job.follow.start", "job.follow.caught_up", "job.request_stop", "job.hand_over",
                              "job.update_code"], trail  # asked to stop only once the follower had caught up
        cut = _update_savepoint(stack, name, updated)  # the old code's savepoint at the cut-over: the rollback's
        with session_scope(stack.settings.database_url) as s:
            cut_run = s.scalar(select(Savepoint.run_id).where(Savepoint.job == name, Savepoint.name == cut["name"]))
        assert (cut["mode"], cut_run) == ("stop", first.id), cut
        summary = airflow.api("GET", f"/dags/update_job/dagRuns/{updated}/taskInstances/summary/xcomEntries/"
                                     "return_value").json()["value"]
        assert summary["strategy"] == "zero_downtime" and summary["downtime_seconds"] is not None, summary
        _assert_fresh_through_the_move(summary, 5.0)
        print("zero-downtime update:", summary)
        # the savepoint the resume took at the cut-over is the Asset event, the stop (which took none) published none
        assert _savepoint_events(stack, updated) == [("resume", cut["name"])]
        _assert_ledger_split(stack, name, cut["stages"], first.id, run.id)
        _committing_on(stack, name, run.id)

        # zero-downtime again: the rollback resumes the old code from the savepoint of the cut-over
        poisoned = airflow.trigger("update_job", {"job": name, "code": _edit(edits, "clicks_poisoned"),
                                                  "stable_batches": 8, "dry_run": False,  # 40 s at 5 s a batch
                                                  "strategy": "zero_downtime"})
        wait_for(lambda: _states(stack, "update_job", poisoned).get("resume") == "success", 900,
                 "the poisoned code resumed")
        # once it has written: a run of new code that fails before its first write hands the job back to the parked
        # run, on the old code, and there is nothing to roll back (the gate's own case, in tests/test_update.py)
        jobs.wait_until_committed(stack.settings, stack.cluster, name)
        generator.pause()
        generator.write_file(keys=["poison"])  # a later batch the new code fails on; the old code counts it
        generator.resume()
        assert airflow.follow("update_job", poisoned, timeout=900) == "failed"
        states = _states(stack, "update_job", poisoned)
        assert (states["gate"], states["rollback"], states["summary"]) == ("failed", "success", "failed"), states
        why = [e.details["reason"] for e in audit.find(stack.settings.database_url, job=name)
               if e.action == "job.rollback"]
        assert len(why) == 1 and why[0].startswith("the stability gate failed: run "), why
        with session_scope(stack.settings.database_url) as s:
            assert Path(jobs.get_job(s, name).code or "").name == "clicks_filtered.py"
        back = jobs.wait_until_committed(stack.settings, stack.cluster, name)
        assert back.from_savepoint == _update_savepoint(stack, name, poisoned)["name"]  # the cut-over's savepoint
        _assert_exact(stack, name, generator)
    finally:
        generator.stop()
        stack.cluster.down()


RESCALED_JOB = Path(__file__).parent.parent / "user_jobs" / "deduplicated_window_counts.py"
STAGE = "deduplicated_counts"


def _batch_counts(settings: Settings, job: str, after: int) -> dict[int, int | None]:
    """The state partitions pinned in each offset log entry of the job's current run after batch `after`."""
    run = jobs.refresh(settings, membership_for(settings), job)
    assert run is not None and run.checkpoint_root
    stage = Path(run.checkpoint_root) / STAGE
    last = checkpoints.last_commit(stage) or 0
    return {batch: state_partitions.partitions(stage, batch) for batch in range(after + 1, last + 1)}


def _update_savepoint(stack: Stack, job: str, run_id: str) -> dict[str, Any]:
    mark = run_id.replace(":", "").replace("+", "")
    return next(sp for sp in savepoints.list_savepoints(stack.settings, job) if sp["name"] == f"update-{mark}")


def _savepoint_events(stack: Stack, run_id: str) -> list[tuple[str, str]]:
    """The changeover_savepoints Asset events an update_job run published: (task, savepoint), from Airflow's API."""
    events = stack.airflow.api("GET", "/assets/events", params={"source_dag_id": "update_job",
                                                                "source_run_id": run_id}).json()["asset_events"]
    return [(e["source_task_id"], e["extra"]["savepoint"]) for e in events if e["name"] == "changeover_savepoints"]


def _rescales(stack: Stack, job: str) -> list[tuple[int, int]]:
    return [(e.details["partitions_before"], e.details["partitions"])
            for e in audit.find(stack.settings.database_url, job=job) if e.action == "job.rescale"]


# 2 min. make test keeps Spark's own repartition of a stopped RocksDB checkpoint, the query resumed on it exact, on a
# local session (tests/test_state_rescale.py's
# test_a_stopped_rocksdb_stages_state_is_repartitioned_and_the_resumed_query_counts_exact), and the rescale's
# decisions without Spark (test_rescale_decisions.py)
@pytest.mark.long
@pytest.mark.only_on("sqlite", "the DAG's steps run once, on the embedded default; the registry's own PostgreSQL "
                     "cases cover the run's column")
def test_update_job_grows_a_jobs_state_partitions_exact_and_a_failed_shrink_rolls_back(
        stack: Stack, tmp_path: Path) -> None:
    """A team's job (a deduplication and a windowed count in one stage, on RocksDB with 4 state partitions) gets
    update_job with state_partitions 8 (its dry run replays a batch on a repartitioned copy). A try at 2 then fails
    right after Spark's repartition, before the planned batch is put back: the gate fails and the rollback resumes
    the savepoint, which is as it was, with 8. Every batch after a resume uses the new count, and the parquet output
    is exactly the ground truth, each duplicate counted once. Spark repartitions both ways: up in the update, down
    in the failed try."""
    name, airflow = "rescaled", stack.airflow
    words, output = Words(tmp_path / "words"), tmp_path / "out" / "counts"
    for _ in range(6):
        words.write()
        words.repeat_last()
    stack.cluster.up([("r1", "4.2.0")])
    try:
        jobs.submit(stack.settings, stack.cluster, str(RESCALED_JOB), name,
                    options={"words": str(words.folder), "output": str(output), "state_store": "rocksdb",
                             "lease_seconds": LEASE_SECONDS, "spark": {"shuffle_partitions": 4}})
        first = jobs.wait_until_committed(stack.settings, stack.cluster, name)
        assert set(_batch_counts(stack.settings, name, -1).values()) == {4}
        with words.writing(repeats=True):
            grown = airflow.trigger("update_job", {"job": name, "code": str(RESCALED_JOB), "state_partitions": 8,
                                                   "stable_batches": 3})
            assert airflow.follow("update_job", grown, timeout=900) == "success", \
                _task_log_tail(stack, grown, "update_job")
            said = "\n".join(_task_log_events(stack, grown, "update_job"))
            assert "CO-SCALE-04 job rescaled, stage deduplicated_counts" in said and "4 -> 8 partitions" in said
            assert re.search(r"dry run: stage deduplicated_counts replayed batch \d+", said), said[-3000:]
            saved = _update_savepoint(stack, name, grown)
            assert _savepoint_events(stack, grown) == [("stop", saved["name"])]
            savepoint_stage = Path(stack.settings.savepoint_dir) / name / saved["name"] / "stages" / STAGE
            assert state_partitions.partitions(savepoint_stage) == 4, "the savepoint keeps its own count"
            savepoints.verify(savepoint_stage.parent.parent)
            at = saved["stages"][STAGE]
            counts = _batch_counts(stack.settings, name, at)
            assert len(counts) >= 3 and set(counts.values()) == {8}, counts
            run = jobs.refresh(stack.settings, stack.cluster, name)
            assert run is not None and run.checkpoint_root
            # the repartition's own batch reads no input; the next batch reads the input after the savepoint's
            assert state_partitions.is_repartition(Path(run.checkpoint_root) / STAGE, at + 1)
            assert not state_partitions.is_repartition(Path(run.checkpoint_root) / STAGE, at + 2)
            assert _rescales(stack, name) == [(4, 8)]
            assert run.id != first.id and run.state_partitions == 8

            faults.arm(stack.settings, "rescale.repartitioned")  # the driver fails after Spark's repartition
            failed = airflow.trigger("update_job", {"job": name, "code": str(RESCALED_JOB), "state_partitions": 2,
                                                    "dry_run": False, "stable_batches": 3,
                                                    "gate_timeout_seconds": 120})
            assert airflow.follow("update_job", failed, timeout=900) == "failed"
            states = _states(stack, "update_job", failed)
            assert (states["resume"], states["gate"], states["rollback"]) == ("success", "failed", "success"), states
            assert any(line.startswith("rescale.repartitioned raise") for line in faults.fired(stack.settings))
            kept = _update_savepoint(stack, name, failed)
            kept_stage = Path(stack.settings.savepoint_dir) / name / kept["name"] / "stages" / STAGE
            savepoints.verify(kept_stage.parent.parent)  # every file as its manifest says: nothing was changed
            assert state_partitions.partitions(kept_stage) == 8
            jobs.wait_until_committed(stack.settings, stack.cluster, name)
            assert set(_batch_counts(stack.settings, name, kept["stages"][STAGE]).values()) == {8}
            assert _rescales(stack, name) == [(4, 8)]  # the failed try failed before its record
        words.flush()
        truth = words.truth()
        wait_for(lambda: parquet_counts(output) == truth, 300, "every closed window in the parquet output")
    finally:
        stack.cluster.down()


# Under `make test-e2e` (4 min): CI keeps the platform's cluster adopted, a host refused, a roll stopped by a lost
# host and its abort (tests/test_existing_cluster.py, without Airflow). Left to this case: a whole roll of the
# platform's cluster, jobs moved on its masters, and the `connection` Param choosing its connection.
@pytest.mark.long
@pytest.mark.only_on("sqlite", "run once: the platform's drivers reach the registry on storage every host sees, a "
                     "SQLite file; this machine's PostgreSQL listens on loopback only, which the hosts do not share")
def test_a_platforms_own_cluster_rolls_through_the_scheduler_one_move_a_job_exact(stack: Stack,
                                                                                  tmp_path: Path) -> None:
    """A Spark standalone cluster Changeover did not start (tests/platform_hosts.py: three hosts of their own, each
    a network namespace with an SSH server, Spark started by its own sbin scripts), rolled by the same Airflow
    through a connection of its own, chosen by the run's `connection` Param. Its tasks reach the members only
    through the cluster file's ssh lines, and their output is in the task logs. No process of LocalCluster runs."""
    why = available()
    if why:
        pytest.skip(why)
    members = ["p1", "p2", "p3"]
    platform, generator = Platform(tmp_path, members, ["4.2.0", "4.3.0"]), None
    airflow = stack.airflow
    try:
        platform.start()
        platform.start_masters()
        for member in members:
            platform.start_worker(member, "4.2.0")
        url = f"sqlite:///{platform.shared / 'registry.db'}"
        migrate(url)
        settings = platform.settings(url)
        cluster = membership_for(settings)
        cluster.up([(m, "4.2.0") for m in members])  # adopted as they run
        generator = start_clicks(settings, cluster, "clicks")
        words, output = _start_guide(settings, cluster)
        airflow.api("POST", "/connections", json={
            "connection_id": "changeover_platform", "conn_type": "changeover",
            "extra": json.dumps({"home": str(settings.home), "database_url": url,
                                 "rest_key_file": str(platform.rest_key_file),
                                 "cluster_file": str(platform.cluster_file)})}).raise_for_status()
        run_id = airflow.trigger("rolling_upgrade", {**CONF, "members": members, "connection": "changeover_platform",
                                                     "replay_check": False})
        state = airflow.follow("rolling_upgrade", run_id, timeout=1500)
        assert state == "success", _task_log_tail(stack, run_id)
        said = "\n".join(_task_log_events(stack, run_id))
        for member in members:  # each restart went through the templates, their output in the roll's log
            assert re.search(rf"stop_worker of member {member}: running ssh -F \S+ {platform.hosts[member]} ", said)
            assert re.search(rf"start_worker of member {member} \| starting org.apache.spark.deploy.worker", said)
        for member in members:
            assert cluster.master("4.3.0").worker_state(platform.hosts[member]) == "ALIVE"
        for name in ("clicks", "guide"):
            run = jobs.refresh(settings, cluster, name)
            assert run is not None and run.spark_version == "4.3.0" and run.state in jobs.LIVE
            made = move_history.of(settings, name)
            assert [(m.from_version, m.to_version) for m in made] == [("4.2.0", "4.3.0")], made
        assert not list(stack.cluster.pid_dir.glob("*.pid"))  # nothing of the embedded cluster ran
        generator.stop()
        wait_for(lambda: clicks.results(url, "clicks")[0] == dict(generator.truth), 300,
                 "clicks catching up with every generated file")
        windows = clicks.results(url, "clicks")[1]
        assert windows and all(generator.window_truth[k] == v for k, v in windows.items())
        for _ in range(12):
            words.write()
        words.flush()
        wait_for(lambda: parquet_counts(output) == words.truth(), 300, "every closed window of the guide job")
    finally:
        if generator is not None:
            generator.stop()
        airflow.api("DELETE", "/connections/changeover_platform")
        platform.close()
