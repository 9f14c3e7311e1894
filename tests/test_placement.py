"""Upgrade-aware placement on the registry (SQLite and PostgreSQL): the drain order and each job's destination,
so that a fault-tolerant job moves once, straight to the target version. The end-to-end rolling upgrade checks
the moves through real drivers; here the members and runs are registry rows."""

from __future__ import annotations

from changeover.cluster import LocalCluster
from changeover.registry.db import session_scope
from changeover.registry.models import Job, JobRun, Master, Member
from changeover.settings import Settings
from changeover.upgrade import drain, lock, placement, roll, verify, warm


def _members(settings: Settings, *specs: tuple[str, str]) -> None:
    with session_scope(settings.database_url) as s:
        for i, (name, version) in enumerate(specs):
            s.add(Member(name=name, version=version, host=f"127.0.1.{i + 1}", status="ACTIVE"))


def _job_on(settings: Settings, job: str, member: str, fault_tolerant: bool = True) -> None:
    with session_scope(settings.database_url) as s:
        s.add(Job(name=job, module="jobs.clicks", fault_tolerant=fault_tolerant, block_shutdown=False, options={}))
        s.flush()
        run = JobRun(job=job, spark_version="4.2.0", master_url="spark://x", state="RUNNING", progress={},
                     member=member)
        s.add(run)
        s.flush()
        s.get(Job, job).current_run_id = run.id


def _set(settings: Settings, member: str, version: str, status: str = "ACTIVE") -> None:
    with session_scope(settings.database_url) as s:
        row = s.get(Member, member)
        row.version, row.status = version, status


def test_members_without_jobs_drain_first_and_each_job_is_planned_to_move_once(settings: Settings) -> None:
    _members(settings, ("m1", "4.2.0"), ("m2", "4.2.0"), ("m3", "4.2.0"))
    _job_on(settings, "clicks", "m1")
    _job_on(settings, "guide", "m2")
    _job_on(settings, "batch", "m1", fault_tolerant=False)  # waited for, not moved: no part of the order

    plan = placement.plan_moves(settings, "4.3.0", ["m1", "m2", "m3"])

    assert plan.order == ["m3", "m1", "m2"]
    assert plan.moves == {"clicks": ["4.2.0", "4.3.0"], "guide": ["4.2.0", "4.3.0"]}
    assert "  job clicks: 4.2.0 -> 4.3.0 (1 move)" in plan.describe()


def test_when_every_member_hosts_a_job_the_first_one_moves_twice_and_the_plan_says_so(settings: Settings) -> None:
    _members(settings, ("m1", "4.2.0"), ("m2", "4.2.0"))
    _job_on(settings, "a", "m1")
    _job_on(settings, "b", "m2")

    plan = placement.plan_moves(settings, "4.3.0", ["m1", "m2"])

    assert plan.order == ["m1", "m2"]
    assert plan.moves == {"a": ["4.2.0", "4.2.0", "4.3.0"], "b": ["4.2.0", "4.3.0"]}
    assert "  job a: 4.2.0 -> 4.2.0 -> 4.3.0 (2 moves)" in plan.describe()


def test_a_moved_job_goes_to_the_target_once_it_has_a_member_though_the_old_group_is_larger(
    settings: Settings,
) -> None:
    _members(settings, ("m1", "4.2.0"), ("m2", "4.2.0"), ("m3", "4.2.0"), ("m4", "4.2.0"))
    lock.begin(settings, "run-1", "4.3.0", dict.fromkeys(["m1", "m2", "m3", "m4"], "4.2.0"))
    roll.start(settings, "run-1", ["m4", "m1", "m2", "m3"])
    _set(settings, "m4", "4.3.0")  # the first member is back at the target
    _set(settings, "m1", "4.2.0", "DRAINING")

    # Mid-upgrade 4.2.0 holds two ACTIVE members and 4.3.0 one; after the upgrade 4.3.0 holds all four.
    assert placement.upgrade_destination(settings, ["m1"], "run-1") == "4.3.0"
    # A drain outside an upgrade keeps the seeds' largest-group rule.
    assert placement.upgrade_destination(settings, ["m1"], None) == "4.2.0"


def test_a_job_whose_standby_waits_on_the_target_keeps_it_though_the_standby_fills_the_target(
    settings: Settings,
) -> None:
    """The target's only member shows no free core once the standbys are on it: a job whose standby runs there still
    goes there (warm); a job without one, or whose standby is still queued, goes to the largest group now rather
    than queue for cores."""
    _members(settings, ("m1", "4.2.0"), ("m2", "4.2.0"), ("m3", "4.2.0"), ("m4", "4.2.0"))
    _job_on(settings, "a", "m1")
    _job_on(settings, "b", "m1")
    _job_on(settings, "c", "m1")
    lock.begin(settings, "run-3", "4.3.0", dict.fromkeys(["m1", "m2", "m3", "m4"], "4.2.0"))
    roll.start(settings, "run-3", ["m4", "m1", "m2", "m3"])
    _set(settings, "m4", "4.3.0")
    _set(settings, "m1", "4.2.0", "DRAINING")
    with session_scope(settings.database_url) as s:
        # a's standby runs on m4; b's is on another group; c's is still queued at the master, holding no cores
        for job, version, member in (("a", "4.3.0", "m4"), ("b", "4.2.1", "m2"), ("c", "4.3.0", None)):
            run = s.get(Job, job).current_run_id
            s.add(JobRun(job=job, spark_version=version, master_url="spark://y", state="STANDBY", standby_of=run,
                         member=member, progress={}))
    _job_on(settings, "d", "m1")  # no standby at all
    full = _Masters(free={"127.0.1.4": 0})

    assert drain.destinations(settings, full, ["a", "b", "c", "d"], "run-3") == {
        "a": "4.3.0", "b": "4.2.0", "c": "4.2.0", "d": "4.2.0"}
    room = _Masters(free={"127.0.1.4": 2})
    assert drain.destinations(settings, room, ["a", "b", "c", "d"], "run-3") == dict.fromkeys("abcd", "4.3.0")


class _Masters:
    """Stands in for the masters' JSON (the free cores per worker host): no Spark runs in these registry tests."""

    def __init__(self, free: dict[str, int]) -> None:
        self.free = free

    def master(self, version: str) -> _Masters:
        return self

    def alive_workers(self) -> list[dict[str, object]]:
        return [{"host": host, "coresfree": cores} for host, cores in self.free.items()]


def test_a_partial_upgrade_keeps_moved_jobs_on_the_group_that_stays_largest(settings: Settings) -> None:
    _members(settings, ("m1", "4.2.0"), ("m2", "4.2.0"), ("m3", "4.2.0"), ("m4", "4.3.0"))
    lock.begin(settings, "run-2", "4.3.0", {"m1": "4.2.0"})
    roll.start(settings, "run-2", ["m1"])
    _set(settings, "m1", "4.2.0", "DRAINING")

    # After it, 4.2.0 keeps two members and 4.3.0 has two: the tie goes to 4.3.0, which has a member now.
    assert placement.upgrade_destination(settings, ["m1"], "run-2") == "4.3.0"
    _members(settings, ("m5", "4.2.0"))
    # With a fifth member 4.2.0 stays the largest group, so the job stays on it.
    assert placement.upgrade_destination(settings, ["m1"], "run-2") == "4.2.0"


def test_the_plan_says_which_moves_can_be_warm_and_why_the_others_are_cold(settings: Settings) -> None:
    _members(settings, ("m1", "4.2.0"), ("m2", "4.2.0"), ("m3", "4.2.0"))
    _job_on(settings, "clicks", "m1")
    _job_on(settings, "legacy", "m2")
    with session_scope(settings.database_url) as s:
        s.get(Job, "legacy").options = {"warm_moves": False}

    assert warm.planned_cold_reason(settings, "clicks", "4.2.0", "4.3.0") is None
    assert warm.planned_cold_reason(settings, "legacy", "4.2.0", "4.3.0") == "its option warm_moves is off"
    assert "moves within the 4.2.0 group" in (warm.planned_cold_reason(settings, "clicks", "4.2.0", "4.2.0") or "")
    with session_scope(settings.database_url) as s:  # preflight asks for each group's master row
        s.add(Master(version="4.2.0", host="127.0.0.1", port=1, webui_port=2, rest_port=3, status="RUNNING"))

    described = verify.preflight(settings, LocalCluster(settings), "4.3.0", [], "plan-1", dry_run=True).describe()

    assert "  job clicks: 4.2.0 -> 4.3.0 (1 move)" in described
    assert described[described.index("  job clicks: 4.2.0 -> 4.3.0 (1 move)") + 1] == (
        "    4.2.0 -> 4.3.0: warm if the 4.3.0 group then has 2 free cores for its standby, else cold")
    assert described[described.index("  job legacy: 4.2.0 -> 4.3.0 (1 move)") + 1] == (
        "    4.2.0 -> 4.3.0: cold: its option warm_moves is off")
