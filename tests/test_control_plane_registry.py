"""Control-plane decisions on the registry alone, on SQLite and PostgreSQL: the one-member-at-a-time gate under
two racing drains, a stopped member left out of a roll, and a failed upgrade's lock taken back."""

from __future__ import annotations

import threading

import pytest
from changeover import audit
from changeover.cluster import LocalCluster
from changeover.errors import ChangeoverError
from changeover.registry.db import session_scope
from changeover.registry.models import Member
from changeover.settings import Settings
from changeover.upgrade import drain, lock, recovery, roll
from sqlalchemy import select


def _members(settings: Settings, *specs: tuple[str, str]) -> None:
    with session_scope(settings.database_url) as s:
        for i, (name, status) in enumerate(specs):
            s.add(Member(name=name, version="4.2.0", host=f"127.0.1.{i + 1}", status=status))


def test_two_drains_begun_at_once_one_wins_and_the_other_is_told_why(settings: Settings) -> None:
    _members(settings, ("m1", "ACTIVE"), ("m2", "ACTIVE"))
    plans = {m: drain.DrainPlan(member=m, status="ACTIVE") for m in ("m1", "m2")}
    barrier, won = threading.Barrier(2), {}

    def begin(member: str) -> None:
        barrier.wait()
        won[member] = drain._begin(settings, plans[member])

    threads = [threading.Thread(target=begin, args=(m,)) for m in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(won.values()) == [False, True], won
    winner = next(m for m, ok in won.items() if ok)
    loser = next(m for m, ok in won.items() if not ok)
    assert plans[loser].blocked_by == [winner]
    with session_scope(settings.database_url) as s:
        assert {m.name: m.status for m in s.scalars(select(Member))} == {winner: "DRAINING", loser: "ACTIVE"}
    assert [e.subject for e in audit.find(settings.database_url, member=winner) if e.action == "drain.begin"] == [
        winner]
    assert not [e for e in audit.find(settings.database_url, member=loser) if e.action == "drain.begin"]


def test_a_stopped_member_is_left_out_of_the_roll_with_the_way_back(settings: Settings) -> None:
    _members(settings, ("m1", "STOPPED"))
    lock.begin(settings, "dag/run1", "4.3.0", {"m1": "4.2.0"})
    roll.start(settings, "dag/run1", ["m1"])
    status = roll.step(settings, LocalCluster(settings), "dag/run1")
    assert status.done and status.phases == {"m1": "SKIPPED"}
    assert "changeover cluster up --members m1 --version 4.2.0" in status.reasons["m1"]
    with session_scope(settings.database_url) as s:
        assert s.get(Member, "m1").status == "STOPPED"


def test_a_failed_upgrade_takes_its_lock_back_only_when_no_other_holds_it(settings: Settings) -> None:
    lock.begin(settings, "dag/a", "4.3.0", {})
    lock.release(settings, "dag/a", "FAILED", "a task failed")
    lock.begin(settings, "dag/b", "4.3.0", {})
    with pytest.raises(ChangeoverError, match="upgrade dag/b to 4.3.0 is still running"):
        recovery.resume(settings, "dag/a")
    lock.release(settings, "dag/b", "SUCCEEDED", "done")
    with pytest.raises(ChangeoverError, match="only a FAILED upgrade can be resumed"):
        recovery.resume(settings, "dag/b")
    recovery.resume(settings, "dag/a")
    recovery.resume(settings, "dag/a")  # again: it holds the lock already
    assert recovery.status(settings, "dag/a")["status"] == "RUNNING"
    lock.require_active(settings, "dag/a")
    assert [e.action for e in audit.find(settings.database_url, upgrade="dag/a")] == [
        "upgrade.begin", "upgrade.end", "upgrade.resume"]


def test_verify_fails_an_upgrade_that_left_a_job_down_and_names_the_savepoint_it_holds(settings: Settings) -> None:
    """Its new version failed the job on its first batch: the DAG must not report success. A job a user stopped,
    or one that was down before the upgrade began, is not the upgrade's doing."""
    import os
    from datetime import timedelta

    from changeover.cluster import processes
    from changeover.registry.models import Job, JobRun, Master, Savepoint, utcnow
    from changeover.upgrade import verify

    with session_scope(settings.database_url) as s:  # this test's own process stands in for the member's worker
        s.add(Member(name="m1", version="4.3.0", host="127.0.1.1", status="ACTIVE", pid=os.getpid(),
                     pid_started=processes.start_ticks(os.getpid())))
        s.add(Master(version="4.3.0", host="127.0.0.1", port=1, webui_port=2, rest_port=3, status="RUNNING"))
    lock.begin(settings, "dag/up", "4.3.0", {"m1": "4.2.0"})
    roll.start(settings, "dag/up", ["m1"], live_jobs=["clicks", "stopped"])  # "old" was already down
    long_ago = utcnow() - timedelta(days=1)
    for name, desired, ended in (("clicks", "RUN", utcnow()), ("stopped", "STOP", utcnow()), ("old", "RUN", long_ago)):
        with session_scope(settings.database_url) as s:
            s.add(Job(name=name, module="jobs.clicks", fault_tolerant=True, block_shutdown=False, options={},
                      desired=desired))
            s.flush()
            run = JobRun(job=name, spark_version="4.3.0", master_url="spark://x", state="FAILED", progress={},
                         error="job clicks: PythonException: poisoned event", ended_at=ended)
            s.add(run)
            s.flush()
            s.get(Job, name).current_run_id = run.id
            s.add(Savepoint(job=name, name=f"drain-m1-run{run.id}-stop1", mode="stop", status="COMPLETED",
                            path="/x", size_bytes=1, spark_version="4.2.0", stages={}, upgrade_key="dag/up"))

    with pytest.raises(ChangeoverError) as failed:
        verify.verify(settings, LocalCluster(settings), "4.3.0", upgrade_key="dag/up")
    said = str(failed.value)
    assert "job clicks is down: its run 1 on Spark 4.3.0 ended FAILED (job clicks: PythonException: poisoned " \
           "event); the upgrade holds its savepoint drain-m1-run1-stop1" in said, said
    assert "stopped" not in said and "job old" not in said
    assert lock.status(settings, "dag/up") == "RUNNING"  # not verified: the lock stays for the finish task
