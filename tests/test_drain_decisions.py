"""What a drain waits for and acts on, as a table: seed 000's shutdown rules over a fake fleet (tests/fake_fleet.py)
and the real registry, on SQLite and PostgreSQL, in seconds. Each case places one job on the member being drained,
as its driver and its master would report it, and checks which list `drain.plan` puts it in."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from changeover import light
from changeover.cluster import wait_for
from changeover.light import ledger
from changeover.registry.db import session_scope
from changeover.registry.models import Job, JobRun, LightJob, Member, utcnow
from changeover.registry.states import LightState
from changeover.settings import Settings
from changeover.upgrade import code_update, drain, zero_downtime
from changeover.upgrade.drain_plan import DrainPlan, JobObservation, Observation, decide
from fake_fleet import FakeFleet
from sqlalchemy import select


@pytest.fixture
def fleet(settings: Settings) -> FakeFleet:
    fleet = FakeFleet(settings)
    fleet.up([("m1", "4.2.0"), ("m2", "4.2.0")])
    return fleet


def _draining(settings: Settings, member: str, for_seconds: float) -> None:
    with session_scope(settings.database_url) as s:
        row = s.get(Member, member)
        row.status, row.drain_started_at = "DRAINING", utcnow() - timedelta(seconds=for_seconds)


def _place(fleet: FakeFleet, member: str, *, fault_tolerant: bool = True, block_shutdown: bool = False,
           shutdown_timeout: int = 30, desired: str = "RUN", driver: str = "RUNNING", state: str = "RUNNING",
           ended: bool = False) -> str:
    """A job whose current run's driver is on `member`, in the state its master reports."""
    settings = fleet.settings
    with session_scope(settings.database_url) as s:
        host = s.get(Member, member).host
        version = s.get(Member, member).version
    submission = fleet.master(version).create({"appArgs": []})
    fake = fleet.driver(submission)
    fake.host, fake.state = host, driver
    with session_scope(settings.database_url) as s:
        job = Job(name="j", module="m", fault_tolerant=fault_tolerant, block_shutdown=block_shutdown,
                  shutdown_timeout=shutdown_timeout, desired=desired, options={})
        s.add(job)
        s.flush()
        run = JobRun(job="j", spark_version=version, master_url="spark://fake", state=state, progress={},
                     member=member, submission_id=submission, heartbeat_at=utcnow(),
                     ended_at=utcnow() if ended else None)
        s.add(run)
        s.flush()
        job.make_current(run)
    return "j"


# (case, job placement, seconds the drain has run, shutdown_timeout cap, the list it lands in)
CASES: list[tuple[str, dict[str, Any], float, int | None, str]] = [
    ("fault-tolerant and running: moved", {}, 1, None, "save"),
    ("asked to move, finishing its batch", {"desired": "MOVE"}, 1, None, "stopping"),
    ("killed on its way to the move: moved from its checkpoint",
     {"desired": "MOVE", "driver": "KILLED", "state": "KILLED", "ended": True}, 1, None, "stopped"),
    ("its worker lost on the way (Spark's ERROR)", {"desired": "MOVE", "driver": "ERROR"}, 1, None, "stopped"),
    ("blockShutdown: waited for", {"fault_tolerant": False, "block_shutdown": True}, 3600, None, "wait"),
    ("within its shutdown timeout", {"fault_tolerant": False, "shutdown_timeout": 30}, 10, None, "grace"),
    ("past its shutdown timeout", {"fault_tolerant": False, "shutdown_timeout": 30}, 31, None, "cancel"),
    ("past the drain's cap on timeouts", {"fault_tolerant": False, "shutdown_timeout": 300}, 10, 5, "cancel"),
    ("parked, its driver still up", {"desired": "RUN", "driver": "RUNNING", "state": "PARKED"}, 1, None,
     "handoff"),
]


@pytest.mark.parametrize(("placement", "seconds", "cap", "lands_in"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_a_drain_sorts_each_job_by_seed_000s_rules(fleet: FakeFleet, placement: dict[str, Any], seconds: float,
                                                   cap: int | None, lands_in: str) -> None:
    name = _place(fleet, "m1", **placement)
    _draining(fleet.settings, "m1", seconds)
    plan = drain.plan(fleet.settings, fleet, "m1", shutdown_timeout=cap)
    found = {kind for kind in ("save", "warming", "stopping", "stopped", "wait", "grace", "cancel", "handoff")
             if name in getattr(plan, kind)}
    assert found == {lands_in}
    # only a batch being finished holds the next step back: otherwise it moves, cancels or decommissions
    assert plan.actionable == (lands_in != "stopping")
    if lands_in == "grace":
        assert plan.grace[name] == pytest.approx(30 - seconds, abs=2)


def test_a_job_on_another_member_is_not_the_drains(fleet: FakeFleet) -> None:
    _place(fleet, "m2")
    _draining(fleet.settings, "m1", 1)
    plan = drain.plan(fleet.settings, fleet, "m1")
    assert not plan.jobs_left and plan.actionable  # nothing left: the next step decommissions


def test_one_drain_at_a_time(fleet: FakeFleet) -> None:
    _draining(fleet.settings, "m2", 1)
    plan = drain.plan(fleet.settings, fleet, "m1")
    assert plan.blocked_by == ["m2"] and not plan.actionable


def test_a_decommissioned_member_waits_out_its_executors_grace_then_may_restart(fleet: FakeFleet) -> None:
    _draining(fleet.settings, "m1", 1)
    fleet.decommission("m1")
    fleet.executors["m1"] = 2  # another member's driver still has executors on it
    waiting = drain.plan(fleet.settings, fleet, "m1", shutdown_timeout=30)
    assert waiting.decommissioned and waiting.executors == 2 and not waiting.actionable
    past = drain.plan(fleet.settings, fleet, "m1", shutdown_timeout=0)
    assert past.executors == 0 and past.executors_left == 2 and past.actionable


def test_a_master_that_does_not_answer_leaves_the_job_where_it_was(fleet: FakeFleet) -> None:
    """No word about a driver is no news: the run is observed again at the next poll, not declared dead."""
    name = _place(fleet, "m1", desired="MOVE")
    _draining(fleet.settings, "m1", 1)
    fleet.master("4.2.0").unanswered.add("status")
    assert drain.plan(fleet.settings, fleet, "m1").stopping == [name]
    with session_scope(fleet.settings.database_url) as s:
        assert s.get(JobRun, s.get(Job, name).current_run_id).ended_at is None


def _commits(stage: Path, batches: range, at: float) -> None:
    """Commit files of `batches` in a stage checkpoint, written at `at` (POSIX seconds)."""
    (stage / "commits").mkdir(parents=True, exist_ok=True)
    for number in batches:
        (stage / "commits" / str(number)).write_text('v1\n{"nextBatchWatermarkMs":0}\n')
        os.utime(stage / "commits" / str(number), (at, at))


def _following(fleet: FakeFleet, name: str, tmp_path: Path, committed: int, replayed: int,
               for_seconds: float) -> None:
    """The job's live run has committed batches 0..committed-1; a ready standby on m2 has followed it read-only for
    `for_seconds`, and replayed `replayed` batches itself after the 3 its savepoint gave it."""
    now = time.time()
    _commits(tmp_path / "live" / "counts", range(committed), now)
    _commits(tmp_path / "follower" / "counts", range(3), now - for_seconds - 60)  # links to the savepoint's files
    _commits(tmp_path / "follower" / "counts", range(3, 3 + replayed), now)
    submission = fleet.master("4.2.0").create({"appArgs": []})
    fleet.driver(submission).host, fleet.driver(submission).state = "m2", "RUNNING"
    with session_scope(fleet.settings.database_url) as s:
        live = s.get(JobRun, s.get(Job, name).current_run_id)
        live.checkpoint_root = str(tmp_path / "live")
        s.add(JobRun(job=name, spark_version="4.2.0", master_url="spark://fake", state="STANDBY", progress={},
                     member="m2", submission_id=submission, heartbeat_at=utcnow(), standby_of=live.id,
                     ready_at=utcnow(), following_since=utcnow() - timedelta(seconds=for_seconds),
                     checkpoint_root=str(tmp_path / "follower")))


# (case, batches the live run committed, the follower's own replays, seconds it has followed, where the job lands)
FOLLOWING = [
    ("two batches behind, within its catch-up: waited on", 5 + 2, 2, 30, "warming"),
    ("level, its replays warm: the step's, to cut over", 5, 2, 30, "save"),
    ("level, but its first replay only: waited on", 4, 1, 30, "warming"),
    ("behind past its catch-up: the step's, to abort it", 5 + 2, 2, 301, "save"),
]


@pytest.mark.parametrize(("committed", "replayed", "for_seconds", "lands_in"), [c[1:] for c in FOLLOWING],
                         ids=[c[0] for c in FOLLOWING])
def test_a_zero_downtime_moves_follower_is_waited_on_until_it_is_level_or_out_of_time(
        fleet: FakeFleet, tmp_path: Path, committed: int, replayed: int, for_seconds: float, lands_in: str) -> None:
    """The roll's trigger and update_job's `follow` trigger wait out a follower's catch-up in the triggerer (the
    drain's `warming`, `code_update.cut_over_due`) instead of waking their task for a step with nothing to do."""
    name = _place(fleet, "m1")
    _draining(fleet.settings, "m1", 1)
    _following(fleet, name, tmp_path, committed, replayed, for_seconds)
    plan = drain.plan(fleet.settings, fleet, "m1")
    assert ([name] == plan.warming, [name] == plan.save) == (lands_in == "warming", lands_in == "save")
    assert plan.actionable == (lands_in == "save")
    assert code_update.cut_over_due(fleet.settings, fleet, name, zero_downtime.CatchUp()) == (lands_in == "save")


def test_a_follower_that_ended_leaves_the_move_to_its_step(fleet: FakeFleet, tmp_path: Path) -> None:
    name = _place(fleet, "m1")
    _draining(fleet.settings, "m1", 1)
    _following(fleet, name, tmp_path, 7, 2, 30)
    with session_scope(fleet.settings.database_url) as s:
        standby = s.scalar(select(JobRun).where(JobRun.standby_of.is_not(None)))
        fleet.driver(str(standby.submission_id)).state = "FAILED"
    assert drain.plan(fleet.settings, fleet, "m1").save == [name]
    assert code_update.cut_over_due(fleet.settings, fleet, name, zero_downtime.CatchUp())


FT = JobObservation("moving", fault_tolerant=True, block_shutdown=False, shutdown_timeout=30, live=True,
                    asked_to_stop=False)
OTHER = JobObservation("report", fault_tolerant=False, block_shutdown=False, shutdown_timeout=30, live=True,
                       asked_to_stop=False)
LIGHT = JobObservation("changeover-light-1", fault_tolerant=False, block_shutdown=True, shutdown_timeout=30, live=True,
                       asked_to_stop=False, light=True)
DRAINING = Observation("m1", "DRAINING", draining_for=10.0, decommissioned=True)

# (case, seen, what the plan says: its non-empty fields)
DECISIONS = [
    ("already drained", Observation("m1", "UPGRADING", jobs=(FT,)), {"status": "DRAINED"}),
    ("another member mid-upgrade", Observation("m1", "ACTIVE", busy_elsewhere=("m2",), jobs=(FT,)),
     {"status": "ACTIVE", "blocked_by": ["m2"]}),
    ("a fault-tolerant job is saved", Observation("m1", "ACTIVE", jobs=(FT,)),
     {"status": "ACTIVE", "save": ["moving"]}),
    ("its standby warms", replace(DRAINING, jobs=(replace(FT, warming=True),)),
     {"warming": ["moving"], "decommissioned": True}),
    ("asked to stop, finishing its batch", replace(DRAINING, jobs=(replace(FT, asked_to_stop=True),)),
     {"stopping": ["moving"], "decommissioned": True}),
    ("parked, to be saved and resumed elsewhere", replace(DRAINING, jobs=(replace(FT, live=False),),
                                                         moving_off=frozenset({"moving"})),
     {"stopped": ["moving"], "decommissioned": True}),
    ("blockShutdown: waited for", replace(DRAINING, jobs=(replace(OTHER, block_shutdown=True),)),
     {"wait": ["report"], "decommissioned": True}),
    ("within its shutdown timeout", replace(DRAINING, jobs=(OTHER,)), {"grace": {"report": 20.0},
                                                                       "decommissioned": True}),
    ("the drain's cap is shorter", replace(DRAINING, jobs=(OTHER,), shutdown_cap=15),
     {"grace": {"report": 5.0}, "decommissioned": True}),
    ("past its shutdown timeout: cancelled", replace(DRAINING, jobs=(OTHER,), draining_for=31.0),
     {"cancel": ["report"], "decommissioned": True}),
    ("a light SQL job (blockShutdown by default): waited for", replace(DRAINING, jobs=(LIGHT,), draining_for=3600),
     {"wait": ["changeover-light-1"], "light": ["changeover-light-1"], "decommissioned": True}),
    ("a light job past its shutdown timeout: interrupted",
     replace(DRAINING, jobs=(replace(LIGHT, block_shutdown=False),), draining_for=31.0),
     {"cancel": ["changeover-light-1"], "light": ["changeover-light-1"], "decommissioned": True}),
    ("moved, its successor's first batch pending", replace(DRAINING, moving_off=frozenset({"moving"})),
     {"handoff": ["moving"], "decommissioned": True}),
    ("empty, others' executors within their grace", replace(DRAINING, executors=2, executor_grace_left=12.34),
     {"decommissioned": True, "executors": 2, "executor_grace": 12.3}),
    ("empty, others' executors past their grace", replace(DRAINING, executors=2, executor_grace_left=-1.0),
     {"decommissioned": True, "executors_left": 2}),
    ("empty and decommissioned: ready for its restart", DRAINING, {"decommissioned": True}),
]


@pytest.mark.parametrize(("seen", "expected"), [c[1:] for c in DECISIONS], ids=[c[0] for c in DECISIONS])
def test_a_drains_plan_from_what_it_sees(seen: Observation, expected: dict[str, Any]) -> None:
    planned, empty = decide(seen), DrainPlan(member="m1", status="")
    said = {k: v for k, v in asdict(planned).items() if k != "member" and v != getattr(empty, k)}
    assert said == {"status": seen.status, **expected}


def _light_job(fleet: FakeFleet, member: str, *, block_shutdown: bool, shutdown_timeout: int = 30) -> str:
    """A light job registered on the member's Connect server, as `changeover.light.session` registers one."""
    with session_scope(fleet.settings.database_url) as s:
        version = s.get(Member, member).version
    return ledger.register(fleet.settings, member, version, "sc://127.0.1.1:1", "session", "alice",
                           statement="SELECT 1",
                           block_shutdown=block_shutdown, shutdown_timeout=shutdown_timeout).tag


def test_a_drain_waits_for_blocking_light_jobs_then_stops_the_members_connect_server(settings: Settings) -> None:
    """Seed 000: SQL holds a drain until it completes; the member's Connect server stops once none is left, and no
    light job is routed to it meanwhile. The fake fleet has no server listening: the interrupt finds nothing to
    interrupt on the wire, and its row still ends INTERRUPTED (the wire part is tests/test_light_jobs.py's)."""
    fleet = FakeFleet(settings)
    fleet.up([("m1", "4.2.0"), ("m2", "4.2.0")], light_jobs=True)
    blocking = _light_job(fleet, "m1", block_shutdown=True)
    timed = _light_job(fleet, "m1", block_shutdown=False, shutdown_timeout=5)
    first = drain.step(settings, fleet, "m1")
    assert first.status == "DRAINING" and sorted(first.light) == sorted([blocking, timed])
    assert first.wait == [blocking] and timed in first.grace and fleet.connect_running("m1")
    assert light.route(settings).member == "m2"  # a DRAINING member gets no new light job
    with pytest.raises(ledger.MemberLeft, match="DRAINING"):
        _light_job(fleet, "m1", block_shutdown=True)
    _draining(settings, "m1", 6)  # past the timed job's shutdown timeout
    second = drain.step(settings, fleet, "m1")
    assert second.wait == [blocking] and not second.grace and fleet.connect_running("m1")
    assert ledger.get(settings, timed).state == "INTERRUPTED"
    ledger.finish(settings, blocking, LightState.SUCCEEDED)
    done = drain.step(settings, fleet, "m1")
    assert not done.light and not fleet.connect_running("m1")
    assert done.status == "DRAINED"


def test_light_jobs_of_a_connect_server_that_died_do_not_hold_a_drain(settings: Settings) -> None:
    fleet = FakeFleet(settings)
    fleet.up([("m1", "4.2.0")], light_jobs=True)
    orphan = _light_job(fleet, "m1", block_shutdown=True)
    fleet.connect_servers.pop("m1")  # the server's process is gone; its row still says RUNNING
    assert drain.step(settings, fleet, "m1").status == "DRAINED"
    assert ledger.get(settings, orphan).state == "INTERRUPTED"


def _light_row(settings: Settings, tag: str, **values: Any) -> None:
    with session_scope(settings.database_url) as s:
        row = s.scalar(select(LightJob).where(LightJob.tag == tag))
        for key, value in values.items():
            setattr(row, key, value)


def test_light_jobs_whose_client_went_silent_or_whose_server_was_restarted_do_not_hold_a_drain(
        settings: Settings) -> None:
    """A killed client leaves its row RUNNING, and a restarted Connect server took the job's session with it: a
    blocking row of either would hold the drain for ever."""
    fleet = FakeFleet(settings)
    fleet.up([("m1", "4.2.0")], light_jobs=True)
    silent, restarted, alive = (_light_job(fleet, "m1", block_shutdown=True) for _ in range(3))
    _light_row(settings, silent, heartbeat_at=utcnow() - timedelta(seconds=ledger.SILENCE_SECONDS + 5))
    _light_row(settings, restarted, server_pid=999)  # an earlier process of the member's server
    plan = drain.step(settings, fleet, "m1")
    assert plan.wait == [alive] and plan.light == [alive]
    assert "the client is gone" in ledger.get(settings, silent).error
    assert "was restarted since" in ledger.get(settings, restarted).error
    assert {ledger.get(settings, tag).state for tag in (silent, restarted)} == {"INTERRUPTED"}
    assert ledger.heartbeat(settings, alive) and not ledger.heartbeat(settings, silent)  # an ended row stays ended


def test_a_running_light_jobs_client_heartbeats_until_its_block_ends(settings: Settings) -> None:
    fleet = FakeFleet(settings)
    fleet.up([("m1", "4.2.0")], light_jobs=True)
    tag = _light_job(fleet, "m1", block_shutdown=True)
    first = ledger.get(settings, tag).heartbeat_at
    with ledger.kept_alive(settings, tag, every=0.05):
        wait_for(lambda: ledger.get(settings, tag).heartbeat_at > first, 10, "a heartbeat")
    wait_for(lambda: not [t for t in threading.enumerate() if t.name == f"heartbeat-{tag}"], 10,
             "the heartbeat thread ending with its block")
