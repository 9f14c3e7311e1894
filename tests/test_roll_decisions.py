"""The roll's member sequence over a fake fleet (tests/fake_fleet.py) and the real registry, without Spark: one
member at a time, drained by seed 000's rules, restarted at the target version, and the decisions around it
(a member stopped by hand, a closed drain window, a drain begun outside the upgrade, a retried step)."""

from __future__ import annotations

from datetime import UTC, datetime, time

import pytest
from changeover.errors import ChangeoverError
from changeover.registry.db import session_scope
from changeover.registry.models import Event, Job, JobRun, Member, utcnow
from changeover.settings import Settings
from changeover.upgrade import lock, recovery, roll, surges
from changeover.upgrade.windows import DrainWindow
from fake_fleet import FakeFleet
from sqlalchemy import select

KEY = "rolling_upgrade/r1"


@pytest.fixture
def fleet(settings: Settings) -> FakeFleet:
    fleet = FakeFleet(settings)
    fleet.up([("m1", "4.2.0"), ("m2", "4.2.0"), ("m3", "4.2.0")])
    lock.begin(settings, KEY, "4.3.0", dict.fromkeys(("m1", "m2", "m3"), "4.2.0"))
    roll.start(settings, KEY, ["m1", "m2", "m3"])
    return fleet


def _roll_until_it_waits(fleet: FakeFleet, **kwargs: object) -> roll.RollStatus:
    status = roll.step(fleet.settings, fleet, KEY, **kwargs)  # type: ignore[arg-type]
    for _ in range(10):  # each step goes as far as it can; a few more find nothing new to do
        if status.done:
            break
        again = roll.step(fleet.settings, fleet, KEY, **kwargs)  # type: ignore[arg-type]
        if again.as_dict() == status.as_dict():
            break
        status = again
    return status


def _versions(settings: Settings) -> dict[str, tuple[str, str]]:
    with session_scope(settings.database_url) as s:
        return {m.name: (m.version, m.status) for m in s.scalars(select(Member))}


def test_an_empty_fleet_rolls_member_by_member_and_the_old_group_goes_away(fleet: FakeFleet) -> None:
    status = _roll_until_it_waits(fleet)
    assert status.done and status.phases == dict.fromkeys(("m1", "m2", "m3"), roll.UPGRADED)
    assert _versions(fleet.settings) == dict.fromkeys(("m1", "m2", "m3"), ("4.3.0", "ACTIVE"))
    assert sorted(fleet.masters) == ["4.3.0"]  # the 4.2.0 master stopped once its group was empty
    with session_scope(fleet.settings.database_url) as s:
        order = [e.subject for e in s.scalars(select(Event).where(Event.action == "member.upgrade").order_by(Event.id))]
    assert order == ["m1", "m2", "m3"]
    with session_scope(fleet.settings.database_url) as s:
        phases = [(e.subject, e.action) for e in s.scalars(select(Event).where(
            Event.action.like("upgrade.member.%")).order_by(Event.id))]
    assert phases == [(m, f"upgrade.member.{p}") for m in ("m1", "m2", "m3") for p in ("draining", "upgraded")]
    assert roll.step(fleet.settings, fleet, KEY).done  # a retried step changes nothing
    assert _versions(fleet.settings) == dict.fromkeys(("m1", "m2", "m3"), ("4.3.0", "ACTIVE"))


def _block_shutdown_job_on(fleet: FakeFleet, member: str) -> str:
    """A blockShutdown job's driver on `member`: its drain waits for it. Returns the driver's submission id."""
    with session_scope(fleet.settings.database_url) as s:
        host = s.get(Member, member).host
    submission = fleet.master("4.2.0").create({"appArgs": []})
    fleet.driver(submission).host = host
    with session_scope(fleet.settings.database_url) as s:
        s.add(Job(name="report", module="m", fault_tolerant=False, block_shutdown=True, options={}))
        s.flush()
        run = JobRun(job="report", spark_version="4.2.0", master_url="spark://fake", state="RUNNING", progress={},
                     member=member, submission_id=submission, heartbeat_at=utcnow())
        s.add(run)
        s.flush()
        s.get(Job, "report").make_current(run)
    return submission


def test_a_block_shutdown_job_holds_its_members_restart_until_it_finishes(fleet: FakeFleet) -> None:
    submission = _block_shutdown_job_on(fleet, "m1")
    waiting = _roll_until_it_waits(fleet)
    assert (waiting.current, waiting.drain.wait) == ("m1", ["report"])
    # still at its version, taking no new work while the job runs on
    assert _versions(fleet.settings)["m1"] == ("4.2.0", "DRAINING") and fleet.is_decommissioned("m1")
    fleet.driver(submission).state = "FINISHED"
    assert _roll_until_it_waits(fleet).done
    assert _versions(fleet.settings)["m1"] == ("4.3.0", "ACTIVE")


def test_a_member_stopped_by_hand_is_skipped_with_the_command_that_brings_it_back(fleet: FakeFleet) -> None:
    with session_scope(fleet.settings.database_url) as s:
        s.get(Member, "m2").status = "STOPPED"
    status = _roll_until_it_waits(fleet)
    assert status.done and status.phases == {"m1": roll.UPGRADED, "m2": roll.SKIPPED, "m3": roll.UPGRADED}
    assert "changeover cluster up --members m2 --version 4.2.0" in status.reasons["m2"]
    assert _versions(fleet.settings)["m2"] == ("4.2.0", "STOPPED")


def test_outside_its_drain_window_no_member_is_drained(fleet: FakeFleet) -> None:
    saturday_night = datetime(2026, 11, 28, 23, 0, tzinfo=UTC)
    window = DrainWindow((6,), time(2, 0), time(4, 0))  # Sundays 02:00-04:00 UTC
    status = _roll_until_it_waits(fleet, window=window, now=saturday_night)
    assert status.done and set(status.phases.values()) == {roll.SKIPPED}
    assert _versions(fleet.settings) == dict.fromkeys(("m1", "m2", "m3"), ("4.2.0", "ACTIVE"))


def test_a_drain_begun_outside_the_upgrade_stops_the_roll_with_what_to_do(settings: Settings) -> None:
    fleet = FakeFleet(settings)
    fleet.up([("m1", "4.2.0"), ("m2", "4.2.0"), ("spare", "4.2.0")])
    lock.begin(settings, KEY, "4.3.0", {"m1": "4.2.0", "m2": "4.2.0"})
    roll.start(settings, KEY, ["m1", "m2"])
    with session_scope(settings.database_url) as s:
        s.get(Member, "spare").status, s.get(Member, "spare").drain_started_at = "DRAINING", utcnow()
    with pytest.raises(ChangeoverError, match=r"member spare is being drained or upgraded outside this upgrade.*"
                                              r"changeover upgrade member spare --to VERSION"):
        roll.step(settings, fleet, KEY)
    assert _versions(settings)["m1"] == ("4.2.0", "ACTIVE")  # nothing was drained


def test_an_abort_mid_drain_returns_the_member_at_its_version_and_frees_the_upgrade(fleet: FakeFleet) -> None:
    """m1's drain waits for a blockShutdown job when the upgrade is aborted."""
    submission = _block_shutdown_job_on(fleet, "m1")
    assert _roll_until_it_waits(fleet).current == "m1"
    assert _versions(fleet.settings)["m1"] == ("4.2.0", "DRAINING")
    status = recovery.abort(fleet.settings, fleet, KEY, "a person changed their mind")  # type: ignore[arg-type]
    assert status["status"] == "ABORTED"
    assert _versions(fleet.settings) == dict.fromkeys(("m1", "m2", "m3"), ("4.2.0", "ACTIVE"))
    # a running job that is not fault-tolerant is never killed to undo a drain: its worker stays decommissioned
    assert fleet.is_decommissioned("m1") and fleet.driver(submission).state == "RUNNING"
    with session_scope(fleet.settings.database_url) as s:
        events = [(e.action, e.subject, e.details.get("still_decommissioned")) for e in s.scalars(select(Event).where(
            Event.action.in_(("drain.abort", "upgrade.abort"))).order_by(Event.id))]
    assert events == [("drain.abort", "m1", True), ("upgrade.abort", KEY, None)]
    lock.begin(fleet.settings, "rolling_upgrade/r2", "4.3.0", dict.fromkeys(("m1", "m2", "m3"), "4.2.0"))
    assert recovery.abort(fleet.settings, fleet, KEY, "again")["status"] == "ABORTED"  # a retry changes nothing


def _alive_workers(fleet: FakeFleet) -> int:
    """Workers whose process runs, decommissioned or not, as the masters see them."""
    return sum(state in ("ALIVE", "DECOMMISSIONED") for m in fleet.masters.values() for state in m.workers.values())


def test_with_surge_alive_workers_never_drop_below_the_starting_count(fleet: FakeFleet) -> None:
    """Seed 000's enlarged cluster: a surge member joins at the target before the first drain and leaves at the
    end, so each member's restart costs no capacity. Counted at every worker stop, where a drop would show."""
    starting, counts = _alive_workers(fleet), []
    stop_worker = fleet.stop_worker

    def counted_stop(member: str, grace: float = 0.0) -> None:
        stop_worker(member, grace)
        counts.append((member, _alive_workers(fleet)))

    fleet.stop_worker = counted_stop  # type: ignore[method-assign]
    status = _roll_until_it_waits(fleet, surge=1)
    assert status.done and status.phases == dict.fromkeys(("m1", "m2", "m3"), roll.UPGRADED)
    assert [m for m, _ in counts] == ["m1", "m2", "m3", "surge-1"]  # the surge member leaves last
    assert min(n for _, n in counts) >= starting, counts
    assert _versions(fleet.settings) == dict.fromkeys(("m1", "m2", "m3"), ("4.3.0", "ACTIVE"))  # surge-1 is gone
    with session_scope(fleet.settings.database_url) as s:
        actions = [e.action for e in s.scalars(select(Event).where(Event.action.like("upgrade.surge.%")))]
    assert actions == ["upgrade.surge.add", "upgrade.surge.remove"]
    assert roll.step(fleet.settings, fleet, KEY, surge=1).done  # a retried step adds no second surge member
    assert "surge-1" not in _versions(fleet.settings)


def test_without_surge_a_restart_costs_a_worker(fleet: FakeFleet) -> None:
    """The baseline the surge test is measured against: the same roll with no surge drops a worker each time."""
    starting, counts = _alive_workers(fleet), []
    stop_worker = fleet.stop_worker

    def counted_stop(member: str, grace: float = 0.0) -> None:
        stop_worker(member, grace)
        counts.append(_alive_workers(fleet))

    fleet.stop_worker = counted_stop  # type: ignore[method-assign]
    assert _roll_until_it_waits(fleet).done
    assert counts and min(counts) == starting - 1


def test_an_aborted_upgrade_removes_its_idle_surge_member(fleet: FakeFleet) -> None:
    surges.add(fleet.settings, fleet, KEY, "4.3.0", 1)  # as the roll's first step does, before any drain
    assert _versions(fleet.settings)["surge-1"] == ("4.3.0", "ACTIVE")
    recovery.abort(fleet.settings, fleet, KEY, reason="test")
    assert "surge-1" not in _versions(fleet.settings)
    assert _versions(fleet.settings) == dict.fromkeys(("m1", "m2", "m3"), ("4.2.0", "ACTIVE"))
