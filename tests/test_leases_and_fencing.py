"""A parked run's lease, the sink's fence and the upgrade lock, on the registry (SQLite and PostgreSQL).

The runs here are registry rows, not Spark drivers: these decisions are taken in the registry under
row locks, and the end-to-end tests drive the same code through real drivers.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from changeover import audit, jobs
from changeover.cluster import LocalCluster, wait_for
from changeover.errors import ChangeoverError
from changeover.handoff import lease
from changeover.handoff.fence import Fenced, hold
from changeover.jobs.intents import ContinueMove, ReplaceParked, Standby
from changeover.registry.db import lock_row, session_scope
from changeover.registry.models import Event, Job, JobRun, Master, Member, utcnow
from changeover.runtime import checkpoints
from changeover.runtime.follower import PlannedPast
from changeover.runtime.sinks import hold_a_write_of
from changeover.settings import Settings
from changeover.timeutil import as_utc
from changeover.upgrade import drain, lock, relocate, roll, verify, warm
from changeover.upgrade.windows import DrainWindow
from sqlalchemy import func, select
from test_follower_decisions import ReplayedFrame
from test_follower_decisions import batch as spark_batch


def write_batch(settings: Settings, run_id: int, batch: int = 5) -> None:
    """What every fenced sink does around its write: hold the fence, then write inside its transaction."""
    with hold(settings.database_url, "clicks", run_id, "totals", batch):
        pass


def _job_with_running_run(settings: Settings, desired: str = "RUN", code: str | None = None) -> int:
    with session_scope(settings.database_url) as s:
        s.add(Job(name="clicks", module="jobs.clicks", code=code, fault_tolerant=True, block_shutdown=False,
                  options={}, desired=desired))
        s.flush()
        run = JobRun(job="clicks", spark_version="4.2.0", master_url="spark://x", state="RUNNING", progress={})
        s.add(run)
        s.flush()
        s.get(Job, "clicks").make_current(run)
        return run.id


def _job_with_parked_run(settings: Settings, lease_left: float) -> int:
    run_id = _job_with_running_run(settings, desired="MOVE")
    lease.park(settings.database_url, "clicks", run_id, {"totals": 4}, seconds=lease_left)
    return run_id


def _successor(settings: Settings) -> int:
    with session_scope(settings.database_url) as s:
        run = JobRun(job="clicks", spark_version="4.3.0", master_url="spark://y", state="SUBMITTED", progress={})
        s.add(run)
        s.flush()
        job = s.get(Job, "clicks")
        job.make_current(run)
        job.desired = "RUN"
        return run.id


def test_a_parked_run_waits_then_resumes_when_its_lease_runs_out(settings: Settings) -> None:
    old = _job_with_parked_run(settings, lease_left=3600)
    assert lease.next_action(settings.database_url, "clicks", old, hold_a_write_of) == "wait"
    with session_scope(settings.database_url) as s:
        s.get(JobRun, old).lease_until = utcnow() - timedelta(seconds=1)
    assert lease.next_action(settings.database_url, "clicks", old, hold_a_write_of) == "resume"
    with session_scope(settings.database_url) as s:
        job, run = s.get(Job, "clicks"), s.get(JobRun, old)
        assert (job.desired, job.current_run_id, run.state, run.parked) == ("RUN", old, "RUNNING", False)
    why = [e.details["reason"] for e in audit.find(settings.database_url, job="clicks") if e.action == "job.unpark"]
    assert why == ["its lease ran out and no successor was launched"]


def test_a_parked_run_exits_once_its_successor_has_written(settings: Settings) -> None:
    old = _job_with_parked_run(settings, lease_left=3600)
    new = _successor(settings)
    assert lease.next_action(settings.database_url, "clicks", old, hold_a_write_of) == "wait"
    write_batch(settings, new)
    assert lease.next_action(settings.database_url, "clicks", old, hold_a_write_of) == "exit"
    with session_scope(settings.database_url) as s:
        assert s.get(JobRun, old).ended_at is not None


def test_an_expired_lease_fences_a_successor_that_has_not_written(settings: Settings) -> None:
    old = _job_with_parked_run(settings, lease_left=3600)
    new = _successor(settings)
    with session_scope(settings.database_url) as s:
        s.get(JobRun, old).lease_until = utcnow() - timedelta(seconds=1)
    assert lease.next_action(settings.database_url, "clicks", old, hold_a_write_of) == "resume"
    with pytest.raises(Fenced, match=f"write of batch 5 of stage totals of job clicks by run {new}: "
                                     f"run {old} is the job's current run"):
        write_batch(settings, new)
    refused = [e for e in audit.find(settings.database_url, job="clicks") if e.action == "sink.fenced"]
    assert [(e.outcome, e.details["run"], e.details["batch"]) for e in refused] == [("refused", new, 5)]
    write_batch(settings, old)


def test_a_successor_that_failed_before_writing_hands_the_job_back_at_once(settings: Settings) -> None:
    """The new version failed the job on its first batch: the parked run resumes without waiting out its lease."""
    old = _job_with_parked_run(settings, lease_left=3600)
    new = _successor(settings)
    assert lease.next_action(settings.database_url, "clicks", old, hold_a_write_of) == "wait"
    with session_scope(settings.database_url) as s:
        failed = s.get(JobRun, new)
        failed.state, failed.error, failed.ended_at = "FAILED", "job clicks: ValueError: broken", utcnow()
    assert lease.next_action(settings.database_url, "clicks", old, hold_a_write_of) == "resume"
    with session_scope(settings.database_url) as s:
        job = s.get(Job, "clicks")
        assert (job.current_run_id, job.desired, s.get(JobRun, old).state) == (old, "RUN", "RUNNING")
    why = [e.details["reason"] for e in audit.find(settings.database_url, job="clicks") if e.action == "job.unpark"]
    assert why == [f"its successor run {new} ended FAILED before writing anything"]


def test_moves_that_ended_before_writing_stop_the_drain_after_one_failure_or_three_tries(settings: Settings) -> None:
    """One successor the new version failed is enough to stop asking the job to move; tries that died of other
    causes (killed, never accepted) are retried, up to three per drain."""

    old = _job_with_parked_run(settings, lease_left=3600)
    since = utcnow() - timedelta(seconds=1)

    def ended_successor(state: str) -> int:
        new = _successor(settings)
        with session_scope(settings.database_url) as s:
            run = s.get(JobRun, new)
            run.state, run.ended_at, run.error = state, utcnow(), f"ended {state}"
        # handed back at once
        assert lease.next_action(settings.database_url, "clicks", old, hold_a_write_of) == "resume"
        lease.park(settings.database_url, "clicks", old, {"totals": 4}, seconds=3600)  # asked to move again
        return new

    ended_successor("KILLED")
    ended_successor("KILLED")
    assert relocate.failed_tries(settings, "clicks", since) == []  # two tries lost to kills: try again
    third = ended_successor("KILLED")
    assert [r.id for r in relocate.failed_tries(settings, "clicks", since)][0] == third
    assert relocate.failed_tries(settings, "clicks", utcnow()) == []  # a later drain starts counting anew
    later = utcnow() - timedelta(milliseconds=1)  # another drain: one failure on the job's own code is enough
    failed = ended_successor("FAILED")
    assert [r.id for r in relocate.failed_tries(settings, "clicks", later)] == [failed]


def test_a_run_never_accepted_by_its_master_ends_once_its_silence_outlasts_the_loss_deadline(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its task died between creating the run and the master's answer: no submission id, and no driver heard."""
    from changeover import jobs

    old = _job_with_parked_run(settings, lease_left=3600)
    new = _successor(settings)
    assert jobs.observe(settings, None, new).ended_at is None  # type: ignore[arg-type]  # no master is asked
    monkeypatch.setenv("CHANGEOVER_LOST_AFTER_SECONDS", "60")
    with session_scope(settings.database_url) as s:
        s.get(JobRun, new).submitted_at = utcnow() - timedelta(seconds=61)
    lost = jobs.observe(settings, None, new)  # type: ignore[arg-type]
    assert (lost.state, lost.error.split(":")[0]) == ("KILLED", "never accepted")  # type: ignore[union-attr]
    # the parked run takes the job back
    assert lease.next_action(settings.database_url, "clicks", old, hold_a_write_of) == "resume"


def test_a_driver_whose_jvm_died_under_it_is_killed_not_failed_by_its_own_code() -> None:
    import os

    from changeover.runtime.driver import jvm_lost
    from py4j.protocol import Py4JError, Py4JNetworkError

    def wrapped(inner: BaseException) -> RuntimeError:
        try:
            try:
                raise inner
            except BaseException as caught:
                raise RuntimeError("query failed") from caught
        except RuntimeError as outer:
            return outer

    gone, alive = -1, os.getppid()  # the parent the driver started under: gone (orphaned), or still there
    assert jvm_lost(wrapped(Py4JNetworkError("Answer from Java side is empty")), gone)
    assert jvm_lost(Py4JError("An error occurred while calling o42.awaitTermination"), gone)  # a reset socket
    # the JVM alive: a py4j error is the job's (an AnalysisException, say)
    assert not jvm_lost(wrapped(Py4JNetworkError("Answer from Java side is empty")), alive, wait=0.2)
    assert not jvm_lost(ConnectionRefusedError(111, "Connection refused"), gone)  # the job's own sockets
    looped = ValueError("the job's own bug")
    looped.__cause__ = looped
    assert not jvm_lost(looped, gone)


@pytest.mark.parametrize(("lease_ended_ago", "successor_heard_ago", "decision"), [
    (1, 2, "wait"),  # alive and still starting: more time
    (1, None, "resume"),  # launched, but its driver was never heard from
    (1, 60, "resume"),  # heard from long ago: stuck
    (250, 2, "resume"),  # alive, but past two more lease lengths (2 x 120 s): the old run takes the job back
])
def test_a_live_successor_still_starting_gets_more_time_but_not_forever(
    settings: Settings, lease_ended_ago: float, successor_heard_ago: float | None, decision: str
) -> None:
    """On a loaded cluster a successor's start may outlast the lease: while its driver heartbeats, the parked
    run waits rather than fence it and start the same slow launch again."""
    old = _job_with_parked_run(settings, lease_left=3600)
    new = _successor(settings)
    with session_scope(settings.database_url) as s:
        s.get(JobRun, old).lease_until = utcnow() - timedelta(seconds=lease_ended_ago)
        s.get(JobRun, new).heartbeat_at = (utcnow() - timedelta(seconds=successor_heard_ago)
                                           if successor_heard_ago is not None else None)
    assert lease.next_action(settings.database_url, "clicks", old, hold_a_write_of) == decision


def test_a_users_stop_is_never_undone_by_the_lease(settings: Settings) -> None:
    old = _job_with_parked_run(settings, lease_left=0)
    with session_scope(settings.database_url) as s:
        s.get(Job, "clicks").desired = "STOP"  # `changeover savepoint clicks NAME --cancel`
    assert lease.next_action(settings.database_url, "clicks", old, hold_a_write_of) == "exit"
    with session_scope(settings.database_url) as s:
        assert s.get(Job, "clicks").desired == "STOP" and s.get(JobRun, old).ended_at is not None


def test_a_parked_run_never_reclaims_from_a_later_run_that_took_over(settings: Settings) -> None:
    old = _job_with_parked_run(settings, lease_left=0)
    taken = _successor(settings)
    assert lease.take_over(settings.database_url, "clicks", taken)
    _successor(settings)  # the job moved on again; this newest run has not written yet
    assert lease.next_action(settings.database_url, "clicks", old, hold_a_write_of) == "exit"


def _reclaimed_then_parked_again(settings: Settings, old: int, new: int, stage: str) -> None:
    """The parked run takes the job back from a successor that wrote nothing and ended, then parks again for the
    move with that successor current once more (as if it had been launched again)."""
    assert lease.next_action(settings.database_url, "clicks", old, hold_a_write_of) == "resume"
    with session_scope(settings.database_url) as s:
        s.get(Job, "clicks").desired = "MOVE"
    lease.park(settings.database_url, "clicks", old, {stage: 4}, seconds=3600)
    with session_scope(settings.database_url) as s:
        s.get(Job, "clicks").make_current(s.get(JobRun, new))


def _left_to_its_successor(settings: Settings, old: int, new: int) -> None:
    assert lease.next_action(settings.database_url, "clicks", old, hold_a_write_of) == "exit"
    with session_scope(settings.database_url) as s:
        assert s.get(Job, "clicks").current_run_id == new and s.get(JobRun, old).ended_at is not None


def test_a_successor_whose_batch_only_the_file_sinks_log_holds_is_not_undone_by_a_reclaim(
        settings: Settings, tmp_path: Path) -> None:
    """A file sink's log entry lands before the registry's transaction commits (the fence holds the job row's lock
    around both). The successor died between the two: the parked run reads the sink's record of which run committed
    each batch, and leaves the job to the successor's checkpoint. The successor's batch is an empty one: it lists
    no data file that could tell its writer."""
    from changeover.runtime import Files
    from changeover.runtime.sinks.files import BATCHES

    out = tmp_path / "out"
    old = _job_with_parked_run(settings, lease_left=3600)
    with session_scope(settings.database_url) as s:
        s.get(JobRun, old).sinks = {"events": Files(str(out)).describe()}
    new = _successor(settings)
    with session_scope(settings.database_url) as s:
        successor = s.get(JobRun, new)
        successor.state, successor.ended_at = "KILLED", utcnow()  # died after its log entry

    def log_entry(batch: int, run: int) -> None:
        for folder in ("_spark_metadata", BATCHES):
            (out / folder).mkdir(parents=True, exist_ok=True)
        (out / BATCHES / f"{batch}.run{run}").write_text('{"sources": ["{\\"logOffset\\":5}"]}')
        (out / "_spark_metadata" / str(batch)).write_text("v1\n")  # an empty batch: no file listed

    log_entry(4, old)  # the parked run's own batch: says nothing about the successor
    _reclaimed_then_parked_again(settings, old, new, "events")
    log_entry(5, new)  # the successor's batch, in the sink's log only
    _left_to_its_successor(settings, old, new)


def test_the_fence_waits_for_a_lease_decision_in_flight(settings: Settings) -> None:
    """The sink's fence and a lease decision take the same lock: a writer waits while it is held."""
    old = _job_with_parked_run(settings, lease_left=3600)
    new = _successor(settings)
    written, fenced = threading.Event(), threading.Event()

    def write() -> None:
        try:
            write_batch(settings, new)
            written.set()
        except Fenced:
            fenced.set()

    with session_scope(settings.database_url) as s:
        lock_row(s, Job, "clicks")  # as `lease.next_action` holds it
        writer = threading.Thread(target=write)
        writer.start()
        assert not (written.wait(timeout=2) or fenced.is_set()), "the writer went on while the job row was locked"
        s.get(Job, "clicks").current_run_id = old  # the lease ran out: the old run reclaims the job
    writer.join(timeout=60)
    assert fenced.is_set() and not written.is_set()  # the waiting write saw the reclaim and was fenced off


def test_a_withdrawn_stop_unparks_the_run(settings: Settings) -> None:
    old = _job_with_parked_run(settings, lease_left=3600)
    with session_scope(settings.database_url) as s:
        s.get(Job, "clicks").desired = "RUN"
    assert lease.next_action(settings.database_url, "clicks", old, hold_a_write_of) == "resume"


def _cluster_rows(settings: Settings) -> None:
    """Members and a master as the registry records them; preflight only reads these rows."""
    with session_scope(settings.database_url) as s:
        s.add(Master(version="4.2.0", host="127.0.0.1", port=1, webui_port=2, rest_port=3, status="RUNNING"))
        for name in ("m1", "m2"):
            s.add(Member(name=name, version="4.2.0", host=f"127.0.1.{name[1]}", status="ACTIVE"))


def test_one_upgrade_at_a_time_and_a_release_frees_the_lock(settings: Settings) -> None:
    _cluster_rows(settings)
    verify.preflight(settings, LocalCluster(settings), "4.3.0", [], upgrade_key="run-a")
    verify.preflight(settings, LocalCluster(settings), "4.3.0", [], upgrade_key="run-a")  # a retry
    with pytest.raises(ChangeoverError, match="upgrade run-b: upgrade run-a to 4.3.0 is still running") as refused:
        verify.preflight(settings, LocalCluster(settings), "4.3.0", [], upgrade_key="run-b")
    assert "changeover upgrades release run-a" in str(refused.value)
    assert lock.release(settings, "run-a", "FAILED", "test")
    assert not lock.release(settings, "run-a", "FAILED", "test")
    with pytest.raises(ChangeoverError, match="upgrade run-a: it has ended as FAILED"):
        lock.require_active(settings, "run-a")  # a cleared task of the ended run changes nothing
    with pytest.raises(ChangeoverError, match="upgrade run-a: it has ended as FAILED"):
        verify.preflight(settings, LocalCluster(settings), "4.3.0", [], upgrade_key="run-a")
    verify.preflight(settings, LocalCluster(settings), "4.3.0", ["m2"], upgrade_key="run-b")
    assert [u["status"] for u in lock.list_upgrades(settings)] == ["FAILED", "RUNNING"]


def test_outside_the_drain_window_no_drain_starts(settings: Settings) -> None:
    _cluster_rows(settings)
    verify.preflight(settings, LocalCluster(settings), "4.3.0", ["m1"], upgrade_key="window-run")
    saturday = utcnow().replace(year=2026, month=11, day=21, hour=10, minute=0)
    status = roll.step(settings, LocalCluster(settings), "window-run", window=DrainWindow.parse("SUN 02:00-04:00"),
                       drain_needs_seconds=600, now=saturday)
    assert status.done and status.phases == {"m1": "SKIPPED"}
    assert status.reasons["m1"].startswith("outside the drain window SUN 02:00-04:00 UTC")
    with session_scope(settings.database_url) as s:
        assert s.get(Member, "m1").status == "ACTIVE"
    assert not [e for e in audit.find(settings.database_url, member="m1") if e.action.startswith("drain.")]


def test_events_filter_by_job_member_upgrade_and_time(settings: Settings) -> None:
    import contextvars

    def as_a_task_of_the_upgrade() -> None:  # in a context of its own, as each Airflow task is
        audit.act_as(audit.Acting("someone via airflow:rolling_upgrade/r1/roll#1", upgrade="up-1"))
        with session_scope(settings.database_url) as s:
            audit.record(s, "drain.begin", "member", "m1")
            audit.record(s, "job.request_stop", "job", "clicks", member="m1")

    contextvars.copy_context().run(as_a_task_of_the_upgrade)
    with session_scope(settings.database_url) as s:
        audit.record(s, "job.launch", "job", "other")
    url = settings.database_url
    assert [e.action for e in audit.find(url, member="m1")] == ["drain.begin", "job.request_stop"]
    assert [e.action for e in audit.find(url, job="clicks")] == ["job.request_stop"]
    assert [e.action for e in audit.find(url, upgrade="up-1")] == ["drain.begin", "job.request_stop"]
    assert audit.find(url, since=utcnow() + timedelta(minutes=1)) == []
    assert [e.action for e in audit.find(url, until=utcnow())][-1] == "job.launch"


def _standby(settings: Settings, of: int) -> int:
    with session_scope(settings.database_url) as s:
        run = JobRun(job="clicks", spark_version="4.3.0", master_url="spark://y", state="STANDBY", standby_of=of,
                     progress={})
        s.add(run)
        s.flush()
        return run.id


class _SparkWithoutExecutors:
    """Stands in for a standby's session on a master with no free cores: its warm-up job never gets a task."""

    def __init__(self) -> None:
        self.released, self.cancelled = threading.Event(), False
        self.sparkContext = self

    def parallelize(self, *args: Any) -> Any:
        self.released.wait(30)
        raise RuntimeError("cancelled")

    def cancelAllJobs(self) -> None:  # noqa: N802 - Spark's name
        self.cancelled = True


def test_a_standbys_own_ready_deadline_counts_from_its_launch(settings: Settings) -> None:
    from changeover.runtime.loop import Driver

    old = _job_with_parked_run(settings, lease_left=1)
    standby = _standby(settings, old)
    with session_scope(settings.database_url) as s:  # its session took almost the whole deadline to start
        s.get(JobRun, standby).submitted_at = utcnow() - timedelta(seconds=lease.STANDBY_READY_SECONDS - 0.5)
    spark = _SparkWithoutExecutors()
    try:
        assert Driver(settings, "clicks", standby).await_hand_over(spark, []) is None
    finally:
        spark.released.set()
    assert spark.cancelled
    with session_scope(settings.database_url) as s:
        run = s.get(JobRun, standby)
        assert run.state == "STOPPED" and run.ended_at is not None
        assert run.error.startswith(f"not ready within {lease.STANDBY_READY_SECONDS:.0f} s of its launch")


def test_a_standby_waits_while_its_predecessor_runs_and_starts_once_handed_the_checkpoint(settings: Settings,
                                                                                            tmp_path) -> None:
    old = _job_with_parked_run(settings, lease_left=1)
    standby = _standby(settings, old)
    assert [j["standby"] for j in jobs.list_jobs(settings)] == [f"run {standby} on its master at 4.3.0, warming"]
    assert lease.mark_ready(settings.database_url, standby, {"totals": {}})
    assert [j["standby"] for j in jobs.list_jobs(settings)] == [f"run {standby} on its master at 4.3.0, ready"]
    assert lease.standby_turn(settings.database_url, "clicks", standby) == "wait"
    assert warm.hand_over(settings, "clicks", standby, old, 1, tmp_path / "restored", "drain-m1-run1-stop1")
    assert not lease.end_standby(settings.database_url, "clicks", standby, "its own deadline, a moment too late")
    assert not jobs.dismiss_standby(settings, None, standby, "a restart's dismissal, too late")  # type: ignore[arg-type]
    assert lease.standby_turn(settings.database_url, "clicks", standby) == "start"
    assert [(j["run"], j["standby"]) for j in jobs.list_jobs(settings)] == [(standby, None)]  # it is the job's run
    with session_scope(settings.database_url) as s:
        job, run, parked = s.get(Job, "clicks"), s.get(JobRun, standby), s.get(JobRun, old)
        assert (job.current_run_id, job.desired) == (standby, "RUN")
        assert (run.state, run.checkpoint_root, run.from_savepoint) == ("RUNNING", str(tmp_path / "restored"),
                                                                        "drain-m1-run1-stop1")
        assert parked.parked  # it waits for the standby's first write, and takes the job back if it fails first
        assert (as_utc(parked.lease_until) - utcnow()).total_seconds() > 60  # the lease counts from the hand-over
    assert lease.next_action(settings.database_url, "clicks", old, hold_a_write_of) == "wait"
    with session_scope(settings.database_url) as s:
        s.get(JobRun, standby).state, s.get(JobRun, standby).ended_at = "FAILED", utcnow()
    assert lease.next_action(settings.database_url, "clicks", old, hold_a_write_of) == "resume"


def test_a_follower_on_new_code_brings_it_at_the_hand_over_and_a_reclaim_brings_the_old_back(settings: Settings,
                                                                                              tmp_path) -> None:
    """A zero-downtime update: the follower was launched with new code, which is the job's only once it owns the
    job; the parked run that takes the job back (the follower failed before writing) brings its own code back."""
    with session_scope(settings.database_url) as s:
        s.add(Job(name="clicks", module="clicks_v1", code="/code/v1.zip", fault_tolerant=True, block_shutdown=False,
                  options={}, desired="MOVE"))
        s.flush()
        run = JobRun(job="clicks", spark_version="4.2.0", master_url="spark://x", state="RUNNING", progress={})
        s.add(run)
        s.flush()
        s.get(Job, "clicks").make_current(run)  # a run from before runs recorded their code
        old = run.id
    lease.park(settings.database_url, "clicks", old, {"totals": 4}, seconds=3600)
    new_code = {"code": "/code/v2.zip", "module": "clicks_v2", "entry": "build"}
    standby = _standby(settings, old)
    with session_scope(settings.database_url) as s:
        s.get(JobRun, standby).code = new_code
        assert s.get(Job, "clicks").code == "/code/v1.zip"  # a standby is not the job's yet
    assert warm.hand_over(settings, "clicks", standby, old, 1, tmp_path / "restored", "update-x")
    with session_scope(settings.database_url) as s:
        job = s.get(Job, "clicks")
        assert (job.code, job.module, job.current_run_id) == ("/code/v2.zip", "clicks_v2", standby)
        assert s.get(JobRun, old).code == {"code": "/code/v1.zip", "module": "clicks_v1", "entry": "build"}
        failed = s.get(JobRun, standby)
        failed.state, failed.ended_at = "FAILED", utcnow()
    assert lease.next_action(settings.database_url, "clicks", old, hold_a_write_of) == "resume"
    with session_scope(settings.database_url) as s:
        job = s.get(Job, "clicks")
        assert (job.code, job.module, job.current_run_id) == ("/code/v1.zip", "clicks_v1", old)
    changes = [(e.details["after"], e.details["run"]) for e in audit.find(settings.database_url, job="clicks")
               if e.action == "job.update_code"]
    assert changes == [("/code/v2.zip", standby), ("/code/v1.zip", old)]


def test_a_hand_over_is_refused_once_the_parked_run_resumed_and_skipped_for_an_ended_standby(settings: Settings,
                                                                                           tmp_path) -> None:
    old = _job_with_parked_run(settings, lease_left=3600)
    standby = _standby(settings, old)
    jobs.dismiss_standby(settings, None, standby, "dismissed for the test")  # type: ignore[arg-type]
    assert not warm.hand_over(settings, "clicks", standby, old, 1, tmp_path, "sp")  # the caller launches cold
    other = _standby(settings, old)
    with pytest.raises(ChangeoverError, match="no longer parked where its savepoint was taken"):
        warm.hand_over(settings, "clicks", other, old, 2, tmp_path, "sp")  # it parked again since: a stale savepoint
    with session_scope(settings.database_url) as s:
        s.get(Job, "clicks").desired = "RUN"
    # the stop was withdrawn
    assert lease.next_action(settings.database_url, "clicks", old, hold_a_write_of) == "resume"
    with pytest.raises(ChangeoverError, match="no longer parked where its savepoint was taken"):
        warm.hand_over(settings, "clicks", other, old, 1, tmp_path, "sp")
    with session_scope(settings.database_url) as s:
        assert s.get(Job, "clicks").current_run_id == old


def test_a_users_stop_between_the_park_and_the_hand_over_stands(settings: Settings, tmp_path) -> None:
    """The job parked for its move and its savepoint is being restored when a user stops it: neither the warm
    hand-over nor a cold successor may then turn it back into a running job."""
    old = _job_with_parked_run(settings, lease_left=3600)
    standby = _standby(settings, old)
    assert lease.mark_ready(settings.database_url, standby, None)
    with session_scope(settings.database_url) as s:
        s.get(Job, "clicks").desired = "STOP"  # what `changeover stop` writes
    with pytest.raises(ChangeoverError, match="no longer asked to move"):
        warm.hand_over(settings, "clicks", standby, old, 1, tmp_path, "sp")
    with pytest.raises(ChangeoverError, match="no longer asked to move"):
        jobs.launch(settings, _MasterAt("4.3.0"), "clicks", "4.3.0", tmp_path, ReplaceParked(old, 1),  # type: ignore[arg-type]
                    from_savepoint="sp")
    with session_scope(settings.database_url) as s:
        assert (s.get(Job, "clicks").current_run_id, s.get(Job, "clicks").desired) == (old, "STOP")
        assert s.scalar(select(func.count()).select_from(JobRun)) == 2  # no successor row was added
    # the user's stop ends the parked run
    assert lease.next_action(settings.database_url, "clicks", old, hold_a_write_of) == "exit"
    assert lease.standby_turn(settings.database_url, "clicks", standby) == "dismissed"


def _follower(settings: Settings, of: int, root: Path, caught_up_to: int = 4) -> int:
    standby = _standby(settings, of)
    assert lease.mark_ready(settings.database_url, standby, None)
    with session_scope(settings.database_url) as s:
        run = s.get(JobRun, standby)
        run.following_since, run.checkpoint_root = utcnow(), str(root)
    lease.report_following(settings.database_url, standby, {"totals": caught_up_to})
    return standby


def _writing(settings: Settings, run_id: int,
             give_up: threading.Event | None = None) -> tuple[threading.Thread, dict[str, BaseException]]:
    raised: dict[str, BaseException] = {}

    def write() -> None:
        try:
            with hold(settings.database_url, "clicks", run_id, "totals", 5, give_up):
                pass
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            raised["error"] = exc
    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread, raised


def test_a_primed_followers_write_waits_for_its_hand_over_and_lands_once_handed(settings: Settings,
                                                                                 tmp_path: Path) -> None:
    """The zero-downtime cut-over: a follower's turn is the cut-over once its predecessor, asked to move, has said
    which batch it stops after; it starts its queries once the predecessor has parked, and their first write waits
    for the hand-over instead of being refused, and lands once handed. Before the park it is refused at once, as is
    any standby's that is not following."""
    old = _job_with_running_run(settings)
    follower = _follower(settings, old, tmp_path / "own")
    warm_only = _standby(settings, old)
    assert lease.standby_turn(settings.database_url, "clicks", follower) == "follow"
    lease.announce_last_batch(settings.database_url, old, {"totals": 4})  # not asked to move: not recorded
    assert lease.stopping_after(settings.database_url, follower) is None
    with session_scope(settings.database_url) as s:
        s.get(Job, "clicks").desired = "MOVE"
    assert lease.standby_turn(settings.database_url, "clicks", follower) == "follow"  # not yet said where it stops
    lease.announce_last_batch(settings.database_url, old, {"totals": 4})
    assert lease.stopping_after(settings.database_url, follower) == {"totals": 4}
    assert lease.standby_turn(settings.database_url, "clicks", follower) == "cut_over"
    began = time.monotonic()
    with pytest.raises(Fenced, match=f"run {old} is the job's current run now"):
        write_batch(settings, follower)  # its predecessor still runs: a write now would be a second writer
    assert time.monotonic() - began < 5  # refused at once, not after waiting for a hand-over
    lease.park(settings.database_url, "clicks", old, {"totals": 4}, seconds=3600)
    assert lease.standby_turn(settings.database_url, "clicks", follower) == "cut_over"
    assert lease.standby_turn(settings.database_url, "clicks", warm_only) == "wait"
    with pytest.raises(Fenced):
        write_batch(settings, warm_only)
    thread, raised = _writing(settings, follower)
    thread.join(timeout=1.0)
    assert thread.is_alive() and not raised, raised  # waiting, not refused
    # nothing written: the parked run waits
    assert lease.next_action(settings.database_url, "clicks", old, hold_a_write_of) == "wait"
    assert warm.hand_over(settings, "clicks", follower, old, 1, tmp_path / "own", "sp")
    thread.join(timeout=30)
    assert not thread.is_alive() and not raised, raised
    with session_scope(settings.database_url) as s:
        assert s.get(JobRun, follower).first_write_at is not None
    # the follower wrote: handed over
    assert lease.next_action(settings.database_url, "clicks", old, hold_a_write_of) == "exit"


def test_a_run_stopping_for_a_move_that_names_no_batch_lets_its_follower_replay_up_to_the_park(
        settings: Settings, tmp_path: Path) -> None:
    """A stage had no batch to wait for, so the stop names none (`StageQueries.stop_at_boundary`): the follower's turn
    is the cut-over at once, with no batch to stop at, so it replays the batches the run still runs beside it, as
    before the move was asked, rather than only committed ones until the park."""
    old = _job_with_running_run(settings, desired="MOVE")
    follower = _follower(settings, old, tmp_path / "own")
    assert lease.standby_turn(settings.database_url, "clicks", follower) == "follow"
    lease.announce_last_batch(settings.database_url, old, {})
    assert lease.standby_turn(settings.database_url, "clicks", follower) == "cut_over"
    assert lease.stopping_after(settings.database_url, follower) is None


def test_a_follower_caught_up_to_an_earlier_park_is_refused_its_first_write(settings: Settings,
                                                                             tmp_path: Path) -> None:
    """A follower caught up to batch 3, handed a job whose run has parked at 4 since (it resumed and parked again
    while the follower was not looking): its first write would come from a state and offsets the job left behind,
    so it is refused, and the parked run takes the job back. Caught up to the parked batch, it writes."""
    old = _job_with_parked_run(settings, lease_left=3600)
    stale = _follower(settings, old, tmp_path / "stale", caught_up_to=3)
    assert warm.hand_over(settings, "clicks", stale, old, 1, tmp_path / "stale", "sp")
    with pytest.raises(Fenced, match=r"caught up to \{'totals': 3\}.* parked at \{'totals': 4\}"):
        write_batch(settings, stale)
    with session_scope(settings.database_url) as s:
        s.get(JobRun, stale).state, s.get(JobRun, stale).ended_at = "FAILED", utcnow()  # what its driver records
    assert lease.next_action(settings.database_url, "clicks", old, hold_a_write_of) == "resume"
    with session_scope(settings.database_url) as s:
        s.get(Job, "clicks").desired = "MOVE"
    lease.park(settings.database_url, "clicks", old, {"totals": 4}, seconds=3600)
    level = _follower(settings, old, tmp_path / "level")
    assert warm.hand_over(settings, "clicks", level, old, 2, tmp_path / "level", "sp")
    write_batch(settings, level)


def test_a_followers_cut_over_ends_when_its_predecessors_stop_fails(settings: Settings, tmp_path: Path) -> None:
    """The predecessor said which batch it stops after, then that batch outran the stop's deadline: the stop is
    withdrawn and the run goes on, so the follower follows on, and the batch it named is forgotten (a later stop
    names its own)."""
    from changeover.runtime.loop import Driver

    old = _job_with_running_run(settings, desired="MOVE")
    follower = _follower(settings, old, tmp_path / "own")
    lease.announce_last_batch(settings.database_url, old, {"totals": 4})
    assert lease.standby_turn(settings.database_url, "clicks", follower) == "cut_over"
    Driver(settings, "clicks", old).stop_failed("MOVE")
    assert lease.stopping_after(settings.database_url, follower) is None
    with session_scope(settings.database_url) as s:
        assert s.get(Job, "clicks").desired == "RUN"
        s.get(Job, "clicks").desired = "MOVE"  # asked again: the follower waits for the new stop to say its batch
    assert lease.standby_turn(settings.database_url, "clicks", follower) == "follow"


def test_a_primed_followers_write_is_refused_once_its_parked_predecessor_takes_the_job_back(
        settings: Settings, tmp_path: Path) -> None:
    """The hand-over does not come: the parked run's lease runs out while the follower's first write waits for it.
    The parked run resumes, and the waiting write is refused (nothing of it lands), so the job has one writer; the
    follower's turn is following again. A write whose driver gives up waiting (it ends its queries) is refused too."""
    old = _job_with_parked_run(settings, lease_left=0)
    lease.announce_last_batch(settings.database_url, old, {"totals": 4})
    follower = _follower(settings, old, tmp_path / "own")
    thread, raised = _writing(settings, follower)
    given_up = threading.Event()
    abandoned, abandoned_raised = _writing(settings, follower, given_up)
    thread.join(timeout=1.0)
    assert thread.is_alive() and abandoned.is_alive() and not raised and not abandoned_raised
    given_up.set()
    abandoned.join(timeout=30)
    assert not abandoned.is_alive() and isinstance(abandoned_raised.get("error"), Fenced), abandoned_raised
    assert thread.is_alive() and not raised, raised  # the other still waits: the lease decides, not the clock
    assert lease.next_action(settings.database_url, "clicks", old, hold_a_write_of) == "resume"
    thread.join(timeout=30)
    assert not thread.is_alive() and isinstance(raised.get("error"), Fenced), raised
    assert lease.standby_turn(settings.database_url, "clicks", follower) == "follow"
    assert lease.stopping_after(settings.database_url, follower) is None  # resumed: its named batch forgotten
    with session_scope(settings.database_url) as s:
        assert s.get(JobRun, follower).first_write_at is None and s.get(Job, "clicks").current_run_id == old
    refused = [e.details for e in audit.find(settings.database_url, job="clicks") if e.action == "sink.fenced"]
    assert [d["run"] for d in refused] == [follower, follower], refused


class _ReplayingFollower:
    """Stands in for a follower's Spark replays (`runtime.follower.Follower`): each step is one batch replayed, up to
    the batch asked; `caught_up` runs once it has replayed the predecessor's last (`at`), as the predecessor's park or
    failed stop would then come. It is never one batch short of it with the predecessor's offsets at hand, so its
    queries start after it replayed that batch."""

    def __init__(self, root: Path, batches: int, at: int, caught_up: Any) -> None:
        self.root, self.committed, self.at, self.caught_up = root, at - batches, at, caught_up
        self.throughs: list[dict[str, int] | None] = []
        self.finished = False

    def level_short_of(self, _through: dict[str, int]) -> bool:
        return False

    def step(self, through: dict[str, int] | None = None) -> bool:
        self.throughs.append(through)
        target = self.at if through is None else through["totals"]
        if self.committed < target:
            self.committed += 1
            return True
        if target >= self.at:
            self.caught_up()
        return False

    def finish(self, replayed: Any = lambda: None) -> dict[str, int | None]:
        replayed()
        self.finished = True
        return {"totals": self.at}


class _QueriesInOrder:
    """Stands in for the job's Spark queries (`runtime.queries.StageQueries`): records their start and stand-down,
    and the follower's row as it stood when they were stood down. Each stage's first batch, its pending offset entry,
    goes to the write hook on a thread of its own, as Spark runs each query's foreachBatch; a stage the hook lets
    through is committed."""

    made: list[_QueriesInOrder] = []

    def __init__(self, stages: list[Any], root: Path, url: str, job: str, run_id: int, replay: Any = None) -> None:
        self.root, self.url, self.run_id, self.replay = root, url, run_id, replay
        self.stages = sorted(replay.through) if replay is not None else ["totals"]
        self.started, self.stopped = False, False
        self.ended_when_stood_down: bool | None = None
        self.started_from: dict[str, int | None] = {}
        self.replayed: list[bool] = []
        self.failed: BaseException | None = None
        self.threads: list[threading.Thread] = []
        _QueriesInOrder.made.append(self)

    def start(self) -> None:
        self.started = True
        committed = self.committed()
        self.started_from = {stage: max(-1 if committed[stage] is None else committed[stage],
                                        self.replay.through[stage] if self.replay is not None else -1)
                             for stage in self.stages}
        if self.replay is not None:
            self.threads = [threading.Thread(target=self._first_batch, args=(stage,)) for stage in self.stages]
            for thread in self.threads:
                thread.start()

    def _first_batch(self, stage: str) -> None:
        pending = checkpoints.last_offsets(self.root / stage)
        try:
            self.replayed.append(self.replay(stage, ReplayedFrame(), pending))
        except Exception as exc:  # noqa: BLE001 - the query's failure, as Spark words it, read through failure()
            self.failed = self.failed or RuntimeError(f"[FOREACH_BATCH_USER_FUNCTION_ERROR] {type(exc).__name__}: "
                                                      f"{exc}")
            return
        spark_batch(self.root / stage, pending, pending, {}, 1_800_000_009.0)  # Spark's commit of it

    def failure(self) -> BaseException | None:
        return self.failed

    def committed(self) -> dict[str, int | None]:
        return {stage: checkpoints.last_commit(self.root / stage) for stage in self.stages}

    def stop_now(self) -> list[str]:
        self.stopped = True
        for thread in self.threads:  # Spark's stop waits for a batch's write to end
            thread.join(timeout=30)
            assert not thread.is_alive(), "a write hook still waits: the stop would hang"
        return self.stages

    def stand_down_now(self) -> list[str]:
        with session_scope(self.url) as s:
            self.ended_when_stood_down = s.get(JobRun, self.run_id).ended_at is not None
        if self.replay is not None:
            self.replay.cancelled.set()
        return self.stop_now()


@pytest.fixture
def driver_queries(monkeypatch: pytest.MonkeyPatch) -> list[_QueriesInOrder]:
    """The driver's cut-over with its Spark parts stood in for: the registry's answers are real."""
    from changeover.runtime import standby

    _QueriesInOrder.made = []
    monkeypatch.setattr(standby, "StageQueries", _QueriesInOrder)  # where `_prime` and `_prime_in_queries` make them
    monkeypatch.setattr(standby, "PRIME_CHECK_SECONDS", 0.0)
    return _QueriesInOrder.made


def test_a_driver_primes_at_the_named_batch_and_starts_its_queries_once_the_job_parked(
        settings: Settings, tmp_path: Path, driver_queries: list[_QueriesInOrder]) -> None:
    """The follower replays up to the batch its predecessor named and no further, waits for the park, takes the
    parked position, reports it before anything could write, and only then starts the job's queries."""
    from changeover.runtime.loop import Driver

    old = _job_with_running_run(settings, desired="MOVE")
    standby = _follower(settings, old, tmp_path / "own", caught_up_to=2)
    lease.announce_last_batch(settings.database_url, old, {"totals": 4})
    parked = lambda: lease.park(settings.database_url, "clicks", old, {"totals": 4}, seconds=3600)  # noqa: E731
    follower = _ReplayingFollower(tmp_path / "own", batches=2, at=4, caught_up=parked)
    queries = Driver(settings, "clicks", standby)._prime(follower, [])  # type: ignore[arg-type]
    assert queries is driver_queries[0] and queries.started and queries.root == tmp_path / "own"
    assert follower.throughs == [{"totals": 3}] * 2 + [{"totals": 4}] * 2 and follower.finished
    with session_scope(settings.database_url) as s:
        row = s.get(JobRun, standby)
        assert row.progress == {"totals": 4} and row.ended_at is None  # the fence's check of its first write
    assert lease.standby_turn(settings.database_url, "clicks", standby) == "cut_over"
    assert _levels(settings) == [(standby, {"totals": 4}, "after_park")]


def test_a_driver_whose_cut_over_ends_before_the_park_starts_nothing_and_follows_on(
        settings: Settings, tmp_path: Path, driver_queries: list[_QueriesInOrder]) -> None:
    """The predecessor named its batch, then its stop failed: the follower, caught up, starts no query, takes no
    pending batch, and is still a follower."""
    from changeover.runtime.loop import Driver

    old = _job_with_running_run(settings, desired="MOVE")
    standby = _follower(settings, old, tmp_path / "own")
    lease.announce_last_batch(settings.database_url, old, {"totals": 4})
    failed = lambda: Driver(settings, "clicks", old).stop_failed("MOVE")  # noqa: E731
    follower = _ReplayingFollower(tmp_path / "own", batches=0, at=4, caught_up=failed)
    assert Driver(settings, "clicks", standby)._prime(follower, []) is None  # type: ignore[arg-type]
    assert driver_queries == [] and not follower.finished
    assert lease.standby_turn(settings.database_url, "clicks", standby) == "follow"


class _FollowerOfOtherStages:
    """Stands in for a follower whose new code dropped a stage its checkpoint holds (`Standby.await_hand_over`), so it
    cannot prime in the job's queries. Each step records the standby's turn, whether it may replay the batch its
    predecessor runs, and the progress its row shows; after `batches` replays the predecessor parks and the job is
    handed over, and `finish` replays one more batch."""

    def __init__(self, settings: Settings, standby: int, old: int, root: Path, batches: int, at: int) -> None:
        self.settings, self.standby, self.old, self.root = settings, standby, old, root
        self.left, self.at = batches, at
        self.steps: list[tuple[str, bool, dict[str, int]]] = []

    def step(self, through: dict[str, int] | None = None, running_too: Any = lambda: True) -> bool:
        with session_scope(self.settings.database_url) as s:
            shown = dict(s.get(JobRun, self.standby).progress)
        self.steps.append((lease.standby_turn(self.settings.database_url, "clicks", self.standby), running_too(),
                           shown))
        if self.left:
            self.left -= 1
            self.at += 1
            return True
        lease.park(self.settings.database_url, "clicks", self.old, {"totals": self.at, "windows": self.at}, 3600)
        assert warm.hand_over(self.settings, "clicks", self.standby, self.old, 1, self.root, "zero-downtime-x")
        return False

    def committed(self) -> dict[str, int | None]:
        return {"totals": self.at}

    def finish(self, replayed: Any = lambda: None) -> dict[str, int | None]:
        self.at += 1
        return self.committed()


def test_a_follower_that_cannot_prime_replays_committed_batches_through_the_cut_over(
        settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its new code has no stage `windows`, which its checkpoint holds: its queries can start only once it is handed
    the job (`run_streaming` decides its stages then). Until then it goes on replaying what the predecessor has
    committed, never the batch it runs, and says how far it got, so there is less to replay after the hand-over.
    Spark's parts stand in."""
    from changeover.runtime import standby as standby_module
    from changeover.runtime.loop import Driver

    old = _job_with_running_run(settings, desired="MOVE")
    root = tmp_path / "own"
    for stage in ("totals", "windows"):
        (root / stage).mkdir(parents=True)
    standby = _follower(settings, old, root, caught_up_to=2)
    with session_scope(settings.database_url) as s:
        s.get(JobRun, old).checkpoint_root = str(tmp_path / "leader")
    lease.announce_last_batch(settings.database_url, old, {"totals": 5, "windows": 5})
    follower = _FollowerOfOtherStages(settings, standby, old, root, batches=2, at=2)
    monkeypatch.setattr(standby_module, "Follower", lambda *_args: follower)
    monkeypatch.setattr(standby_module, "warm_up", lambda _spark, _seconds: True)
    monkeypatch.setattr(standby_module, "STANDBY_WAIT_SECONDS", 10.0)  # the old loop waited idle: it ends, not hangs
    handed = Driver(settings, "clicks", standby).await_hand_over(None, [SimpleNamespace(name="totals")])
    assert handed is not None and handed.root == root and handed.queries is None
    assert follower.steps == [("cut_over", False, {"totals": 2}), ("cut_over", False, {"totals": 3}),
                              ("cut_over", False, {"totals": 4})]
    with session_scope(settings.database_url) as s:
        assert s.get(JobRun, standby).progress == {"totals": 5}  # where `finish` brought it after the hand-over


@pytest.mark.parametrize("handed", [False, True], ids=["following", "handed-meanwhile"])
def test_a_follower_whose_next_batch_its_predecessor_purged_ends_and_removes_its_checkpoint(
        settings: Settings, tmp_path: Path, handed: bool) -> None:
    """Spark purged the offsets of the batch the follower needs next (it fell further behind than
    spark.sql.streaming.minBatchesToRetain): it cannot follow, so it ends by itself, having written nothing, and
    removes its own checkpoint, which an abort that finds it ended would not. The job was never stopped for it.
    Handed the job a moment before, it is the job's run: it is not ended, and its checkpoint stays."""
    from changeover.runtime.follower import Follower
    from changeover.runtime.loop import Driver

    old = _job_with_parked_run(settings, lease_left=3600) if handed else _job_with_running_run(settings)
    leader, own = tmp_path / "leader", tmp_path / "own"
    for n in range(6):
        spark_batch(leader / "totals", n, n, {n: 1_800_000_000.0 + n}, 1_800_000_001.0 + n)
    for n in range(3):
        spark_batch(own / "totals", n, n, {n: 1_800_000_000.0 + n}, 1_800_000_001.0 + n)
    (leader / "totals" / "offsets" / "3").unlink()
    standby = _follower(settings, old, own, caught_up_to=2)
    if handed:
        assert warm.hand_over(settings, "clicks", standby, old, 1, own, "zero-downtime-x")
    driver = Driver(settings, "clicks", standby)
    follower = Follower(None, [SimpleNamespace(name="totals")], own, leader, driver._leader_stopped)  # type: ignore[list-item]
    assert not driver._follow(follower)
    assert own.exists() == handed and (leader / "totals" / "commits" / "5").exists()
    with session_scope(settings.database_url) as s:
        row, job = s.get(JobRun, standby), s.get(Job, "clicks")
        if handed:
            assert (row.state, row.ended_at, job.current_run_id) == ("RUNNING", None, standby)
        else:
            assert row.state == "STOPPED" and "no longer holds that batch's offsets" in row.error
            assert job.current_run_id == old and s.get(JobRun, old).ended_at is None
    assert lease.standby_turn(settings.database_url, "clicks", standby) == ("start" if handed else "dismissed")


def test_a_follower_sees_its_predecessor_asked_to_move_only_while_it_is_the_jobs_run(settings: Settings,
                                                                                    tmp_path: Path) -> None:
    """While the predecessor is asked to move, its follower replays only committed batches (`Standby._follow`): the
    one it runs may be its last. Not asked, or no longer the job's run, it replays the running batch too."""
    old = _job_with_running_run(settings)
    follower = _follower(settings, old, tmp_path / "own")
    assert not lease.predecessor_moving(settings.database_url, follower)
    with session_scope(settings.database_url) as s:
        s.get(Job, "clicks").desired = "MOVE"
    assert lease.predecessor_moving(settings.database_url, follower)
    _successor(settings)  # the job's run is another now
    assert not lease.predecessor_moving(settings.database_url, follower)


def _short_of_the_last_batch(settings: Settings, tmp_path: Path,
                             stages: tuple[str, ...] = ("totals",)) -> tuple[int, Path, Path]:
    """A running run asked to move that said it stops after batch 3 of each stage, which it committed before it
    parked; its follower committed up to 2."""
    old = _job_with_running_run(settings, desired="MOVE")
    leader, own = tmp_path / "leader", tmp_path / "own"
    for stage in stages:
        for n in range(4):
            spark_batch(leader / stage, n, n, {n: 1_800_000_000.0 + n}, 1_800_000_001.0 + n)
        for n in range(3):
            spark_batch(own / stage, n, n, {n: 1_800_000_000.0 + n}, 1_800_000_001.0 + n)
    lease.announce_last_batch(settings.database_url, old, dict.fromkeys(stages, 3))
    lease.park(settings.database_url, "clicks", old, dict.fromkeys(stages, 3), seconds=3600)
    return old, leader, own


def test_a_driver_short_of_the_last_batch_starts_the_jobs_queries_there_and_is_level_once_they_replayed_it(
        settings: Settings, tmp_path: Path, driver_queries: list[_QueriesInOrder]) -> None:
    """The queries start on the predecessor's last batch, run it without writing, and the follower says it is level
    there before any write of its own; their first commit of their own is the batch after it."""
    from changeover.runtime.follower import Follower
    from changeover.runtime.loop import Driver

    old, leader, own = _short_of_the_last_batch(settings, tmp_path)
    standby = _follower(settings, old, own, caught_up_to=2)
    driver = Driver(settings, "clicks", standby)
    follower = Follower(None, [SimpleNamespace(name="totals")], own, leader, driver._leader_stopped)  # type: ignore[list-item]
    queries = driver._prime(follower, [])  # type: ignore[arg-type]
    assert queries is driver_queries[0] and queries.replayed == [True] and not queries.stopped
    assert queries.started_from == {"totals": 3} and checkpoints.last_commit(own / "totals") == 3
    with session_scope(settings.database_url) as s:
        assert s.get(JobRun, standby).progress == {"totals": 3}
    assert _levels(settings) == [(standby, {"totals": 3}, "in_queries")]


def _levels(settings: Settings) -> list[tuple[int, dict[str, int], str]]:
    """The audit's record of each follower level at the cut-over, and how it got there."""
    return [(e.details["run"], e.details["at"], e.details["how"])
            for e in audit.find(settings.database_url, job="clicks") if e.action == "job.follow.level"]


def test_a_driver_short_of_the_last_batch_whose_predecessor_planned_past_it_stops_its_queries_unwritten(
        settings: Settings, tmp_path: Path, driver_queries: list[_QueriesInOrder]) -> None:
    """The predecessor logged batch 4 as its stop came: the queries stop, their replay of 3 uncommitted, before
    planning a 4 of their own, and the follower is not said level (it then primes from the predecessor's checkpoint,
    taking its 4: `Follower.finish`)."""
    from changeover.runtime.follower import Follower
    from changeover.runtime.loop import Driver

    old, leader, own = _short_of_the_last_batch(settings, tmp_path)
    spark_batch(leader / "totals", 4, 4, {4: 1_800_000_004.0}, None)
    standby = _follower(settings, old, own, caught_up_to=2)
    driver = Driver(settings, "clicks", standby)
    follower = Follower(None, [SimpleNamespace(name="totals")], own, leader, driver._leader_stopped)  # type: ignore[list-item]
    assert driver._prime_in_queries(follower, [], {"totals": 3}) is None  # type: ignore[arg-type]
    assert driver_queries[0].stopped and driver_queries[0].replayed == [] and driver._queries is None
    assert checkpoints.last_commit(own / "totals") == 2 and checkpoints.last_offsets(own / "totals") == 3
    with session_scope(settings.database_url) as s:
        assert s.get(JobRun, standby).progress == {"totals": 2}


@pytest.mark.parametrize("planned_past", [False, True], ids=["level", "windows-planned-past"])
def test_a_driver_short_of_the_last_batch_of_two_stages_commits_it_in_both_or_in_neither(
        settings: Settings, tmp_path: Path, driver_queries: list[_QueriesInOrder], planned_past: bool) -> None:
    """The demo's `clicks` has two stages, each a query of its own: the follower is said level once both have
    replayed the predecessor's last batch; when the predecessor logged a batch past it in one stage, neither commits
    it, and both prime from the predecessor's checkpoint (`Follower.finish`)."""
    from changeover.runtime.follower import Follower
    from changeover.runtime.loop import Driver

    old, leader, own = _short_of_the_last_batch(settings, tmp_path, stages=("totals", "windows"))
    if planned_past:
        spark_batch(leader / "windows", 4, 4, {4: 1_800_000_004.0}, None)
    standby = _follower(settings, old, own, caught_up_to=2)
    driver = Driver(settings, "clicks", standby)
    follower = Follower(None, [SimpleNamespace(name="totals"), SimpleNamespace(name="windows")], own, leader,  # type: ignore[list-item]
                        driver._leader_stopped)
    queries = driver._prime_in_queries(follower, [], {"totals": 3, "windows": 3})  # type: ignore[arg-type]
    with session_scope(settings.database_url) as s:
        progress = s.get(JobRun, standby).progress
    committed = {stage: checkpoints.last_commit(own / stage) for stage in ("totals", "windows")}
    if planned_past:
        assert queries is None and driver_queries[0].stopped and driver_queries[0].replayed == []
        assert committed == {"totals": 2, "windows": 2} and progress == {"totals": 2}
        assert isinstance(driver_queries[0].replay.raised, PlannedPast) and _levels(settings) == []
    else:
        assert queries is driver_queries[0] and queries.replayed == [True, True] and not queries.stopped
        assert committed == {"totals": 3, "windows": 3} and progress == {"totals": 3, "windows": 3}


class _WindowsCommitsLate(_QueriesInOrder):
    """Both stages are level; `totals` commits the last batch, and then the move is withdrawn (the job stays with its
    predecessor) before `windows` commits it: Spark's stop of its query comes first."""

    def _first_batch(self, stage: str) -> None:
        if stage == "totals":
            super()._first_batch(stage)
            with session_scope(self.url) as s:
                s.get(Job, "clicks").desired = "RUN"
            return
        self.replayed.append(self.replay(stage, ReplayedFrame(), checkpoints.last_offsets(self.root / stage)))
        wait_for(lambda: self.stopped, 30, "its queries stopped")

    def stop_now(self) -> list[str]:
        self.committed_at_stop = self.committed()
        return super().stop_now()


def test_a_driver_whose_cut_over_ends_after_a_stage_committed_the_last_batch_ends_rather_than_follows_on(
        settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One stage's checkpoint holds the predecessor's last batch, committed by the job's own queries, which may have
    begun to plan the next alone: that checkpoint can no longer follow the predecessor, so the follower ends, having
    written nothing, instead of following on (the next step starts another)."""
    from changeover.runtime import standby as standby_module
    from changeover.runtime.follower import Follower
    from changeover.runtime.loop import Driver

    _QueriesInOrder.made = []
    monkeypatch.setattr(standby_module, "StageQueries", _WindowsCommitsLate)
    monkeypatch.setattr(standby_module, "PRIME_CHECK_SECONDS", 0.0)
    old, leader, own = _short_of_the_last_batch(settings, tmp_path, stages=("totals", "windows"))
    standby = _follower(settings, old, own, caught_up_to=2)
    moving = Driver(settings, "clicks", standby)
    follower = Follower(None, [SimpleNamespace(name="totals"), SimpleNamespace(name="windows")], own, leader,  # type: ignore[list-item]
                        moving._leader_stopped)
    assert moving._prime(follower, []) is None  # type: ignore[arg-type]
    assert _QueriesInOrder.made[0].committed_at_stop == {"totals": 3, "windows": 2}
    with session_scope(settings.database_url) as s:
        row = s.get(JobRun, standby)
        assert row.state == "STOPPED" and row.ended_at is not None, row.error
        assert "had committed its predecessor's last batch" in row.error
    assert lease.standby_turn(settings.database_url, "clicks", standby) == "dismissed"
    assert not own.exists()  # it may hold a batch its queries planned alone: nobody can follow on from it


@pytest.mark.parametrize("handed", [False, True], ids=["taken-back", "handed-meanwhile"])
def test_a_primed_driver_whose_cut_over_ends_is_ended_before_its_queries_stand_down(
        settings: Settings, tmp_path: Path, driver_queries: list[_QueriesInOrder], handed: bool) -> None:
    """Its queries started and the hand-over did not come: the standby is ended first, so a write waiting in the
    fence is refused rather than let through, then its queries stand down and its checkpoint, which may hold a batch
    they planned alone, is removed. Handed the job in that moment, it keeps its checkpoint and starts again."""
    from changeover.runtime.loop import Driver
    from changeover.runtime.standby import Handed

    old = _job_with_parked_run(settings, lease_left=3600)
    root = tmp_path / "own"
    (root / "totals" / "offsets").mkdir(parents=True)
    standby = _follower(settings, old, root)
    if handed:
        assert warm.hand_over(settings, "clicks", standby, old, 1, root, "sp")
    queries = _QueriesInOrder([], root, settings.database_url, "clicks", standby)
    follower = _ReplayingFollower(root, batches=0, at=4, caught_up=lambda: None)
    after = Driver(settings, "clicks", standby)._unprime(queries, follower, None, "the move was withdrawn")  # type: ignore[arg-type]
    with session_scope(settings.database_url) as s:
        row = s.get(JobRun, standby)
        state, error = row.state, row.error
    if handed:
        assert after == Handed(root, None, None) and root.is_dir() and state == "RUNNING"
        assert queries.ended_when_stood_down is False
    else:
        assert after is None and not root.exists() and state == "STOPPED"
        assert error == "the move was withdrawn: it ends, having written nothing"
        assert queries.ended_when_stood_down is True  # ended before its queries stood down


class _MasterAt:
    """Only what a launch asks before it touches the registry: the master's version (no Spark here)."""

    def __init__(self, version: str) -> None:
        self.version = version

    def master(self, version: str) -> _MasterAt:
        return self

    def server_version(self) -> str:
        return self.version

    def driver_python(self, version: str) -> str:
        return f"/fake/spark-{version}/bin/python"


def test_a_standby_leaves_when_its_predecessor_is_no_longer_the_jobs_run(settings: Settings) -> None:
    old = _job_with_parked_run(settings, lease_left=3600)
    standby = _standby(settings, old)
    _successor(settings)  # a cold launch went first
    assert lease.standby_turn(settings.database_url, "clicks", standby) == "dismissed"
    lease.end_standby(settings.database_url, "clicks", standby, "dismissed")
    lease.end_standby(settings.database_url, "clicks", standby, "ended twice")  # the first end stands
    with session_scope(settings.database_url) as s:
        run = s.get(JobRun, standby)
        assert run.state == "STOPPED" and run.ended_at is not None and run.error == "dismissed"
    assert not lease.mark_ready(settings.database_url, standby, None)  # an ended standby never says it is ready
    assert [e.action for e in audit.find(settings.database_url, job="clicks")].count("job.standby.end") == 1


def _wanted_job(s: Any, name: str, *runs: JobRun) -> None:
    """A fault-tolerant job desired RUN with its runs, oldest first; the last is its current run."""
    s.add(Job(name=name, module="jobs.clicks", fault_tolerant=True, block_shutdown=False, options={}))
    s.flush()
    for run in runs:
        run.job, run.master_url, run.progress = name, "spark://x", {}
        s.add(run)
    s.flush()
    s.get(Job, name).current_run_id = runs[-1].id


class _DecommissionedMember:
    """Stands in for a master: these runs have no submission, so only the drain's own questions reach it."""

    def is_decommissioned(self, member: str) -> bool:
        return True

    def executors_on(self, member: str) -> int:
        return 0

    def connect_running(self, member: str) -> bool:
        return False  # it serves no light jobs

    def stop_connect(self, member: str, grace: float = 0.0) -> bool:
        return False


def test_a_drain_keeps_a_job_whose_run_was_killed_during_it_and_not_one_killed_before(settings: Settings) -> None:
    with session_scope(settings.database_url) as s:
        s.add(Member(name="m1", version="4.2.0", host="127.0.1.1", status="DRAINING",
                     drain_started_at=utcnow() - timedelta(minutes=1)))
        for name, ended in (("during", utcnow()), ("before", utcnow() - timedelta(minutes=5))):
            _wanted_job(s, name, JobRun(spark_version="4.2.0", state="KILLED", member="m1", ended_at=ended))

    planned = drain.plan(settings, _DecommissionedMember(), "m1")  # type: ignore[arg-type]

    assert planned.stopped == ["during"]  # moved from its checkpoint once the member is decommissioned
    assert not planned.done


def test_a_drain_waits_for_a_moved_jobs_first_batch_on_its_new_run_for_a_bounded_time(settings: Settings) -> None:
    began = utcnow() - timedelta(minutes=5)
    with session_scope(settings.database_url) as s:
        s.add(Member(name="m1", version="4.2.0", host="127.0.1.1", status="DRAINING", drain_started_at=began))
        for name, old_ended in (("fresh", utcnow()), ("idle", utcnow()), ("stuck", utcnow() - timedelta(minutes=2))):
            _wanted_job(s, name, JobRun(spark_version="4.2.0", state="STOPPED", member="m1", ended_at=old_ended),
                        JobRun(spark_version="4.3.0", state="RUNNING", member="m3"))

    # "stuck" never finished a trigger after its move: its wait is over, so the member's restart is not held forever
    assert drain.plan(settings, _DecommissionedMember(), "m1").handoff == ["fresh", "idle"]  # type: ignore[arg-type]
    with session_scope(settings.database_url) as s:
        s.get(JobRun, s.get(Job, "fresh").current_run_id).first_commit_at = utcnow()
        s.get(JobRun, s.get(Job, "idle").current_run_id).first_trigger_at = utcnow()  # no input: nothing to commit
    assert drain.plan(settings, _DecommissionedMember(), "m1").handoff == []  # type: ignore[arg-type]


class _StragglerExecutor(_DecommissionedMember):
    """One executor stays on the decommissioned worker: Spark's race (it registered with its driver just after the
    decommission, so nobody told it) cannot be provoked on purpose, so the master's answer stands in for it."""

    def executors_on(self, member: str) -> int:
        return 1


@pytest.mark.parametrize("decommissioned_ago, waits", [(10, True), (40, False)])
def test_a_straggler_executor_holds_the_members_restart_only_for_its_grace(
        settings: Settings, decommissioned_ago: int, waits: bool) -> None:
    with session_scope(settings.database_url) as s:
        s.add(Member(name="m1", version="4.2.0", host="127.0.1.1", status="DRAINING",
                     drain_started_at=utcnow() - timedelta(minutes=1)))
        s.add(Event(at=utcnow() - timedelta(seconds=decommissioned_ago), actor="test", action="member.decommission",
                    subject_kind="member", subject="m1", outcome="ok", details={}))

    planned = drain.step(settings, _StragglerExecutor(), "m1", shutdown_timeout=30)  # type: ignore[arg-type]

    assert planned.done is not waits and planned.actionable is not waits
    assert (planned.executors, planned.executors_left) == ((1, 0) if waits else (0, 1))
    if waits:
        assert planned.executor_grace is not None and 15 < planned.executor_grace <= 20
    else:
        [complete] = [e for e in audit.find(settings.database_url, member="m1") if e.action == "drain.complete"]
        assert complete.details["executors_left"] == 1


def test_verify_stops_a_master_whose_group_has_no_member_left(settings: Settings) -> None:
    """The target's master started for an upgrade that then upgraded no member (or an old group's master, when the
    task that emptied it died before stopping it). Its row has no process: nothing is signalled here."""
    _cluster_rows(settings)
    with session_scope(settings.database_url) as s:
        s.add(Master(version="4.3.0", host="127.0.0.1", port=4, webui_port=5, rest_port=6, status="RUNNING"))

    assert LocalCluster(settings).stop_empty_masters() == ["4.3.0"]
    assert LocalCluster(settings).stop_empty_masters() == []  # safe to repeat
    with session_scope(settings.database_url) as s:
        assert {m.version: m.status for m in s.scalars(select(Master))} == {"4.2.0": "RUNNING", "4.3.0": "STOPPED"}


def test_an_abort_whose_relaunch_fails_names_the_job_left_down_and_its_savepoint(settings: Settings) -> None:
    """The old group's master does not answer (nothing listens on its port): the withdrawn move cannot relaunch the
    job, so the abort fails naming the job and the savepoint to resume it from, keeps the upgrade's lock, and can be
    run again."""
    from changeover.registry.models import Savepoint, UpgradeRun
    from changeover.upgrade import recovery

    _cluster_rows(settings)
    lock.begin(settings, "up-1", "4.3.0", {})
    with session_scope(settings.database_url) as s:
        s.scalar(select(UpgradeRun).where(UpgradeRun.key == "up-1")).progress = {"jobs": ["clicks"]}
        s.add(Job(name="clicks", module="jobs.clicks", fault_tolerant=True, block_shutdown=False, options={},
                  desired="MOVE"))
        s.flush()
        run = JobRun(job="clicks", spark_version="4.2.0", master_url="spark://127.0.0.1:1", state="KILLED",
                     progress={}, member="m1", ended_at=utcnow(), error="its worker was lost")
        s.add(run)
        s.flush()
        s.get(Job, "clicks").current_run_id = run.id
        s.add(Savepoint(job="clicks", name="up-1-clicks", mode="stop", status="COMPLETED", path="/nowhere",
                        size_bytes=1, spark_version="4.2.0", stages={"totals": 4}, run_id=run.id,
                        upgrade_key="up-1"))

    for _ in range(2):  # the same answer again: nothing was half done
        with pytest.raises(ChangeoverError) as refused:
            recovery.abort(settings, LocalCluster(settings), "up-1")
        said = str(refused.value)
        assert "abort of upgrade up-1: job clicks is down" in said and "savepoint up-1-clicks" in said, said
        assert "changeover upgrade abort" in said
    assert recovery.status(settings, "up-1")["locked"]
    with session_scope(settings.database_url) as s:
        assert s.get(Job, "clicks").desired == "MOVE"
    failed = [e for e in audit.find(settings.database_url, upgrade="up-1") if e.action == "upgrade.abort"]
    assert [e.outcome for e in failed] == ["failed", "failed"]


def test_a_savepoint_being_built_holds_the_parked_runs_lease_and_only_while_it_builds(
        settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """A build slower than the lease (large state, a store on another filesystem) used to let the parked run resume
    under it, and the next try park it again under a new savepoint, so the job never moved."""
    from changeover.cluster import wait_for
    from changeover.registry.models import Savepoint
    from changeover.savepoints import taking

    monkeypatch.setenv("CHANGEOVER_LEASE_SECONDS", "3")  # the job's lease, renewed every second while building
    run_id = _job_with_parked_run(settings, lease_left=1)
    with session_scope(settings.database_url) as s:
        first_until = as_utc(s.get(JobRun, run_id).lease_until)
        s.add(Savepoint(job="clicks", name="sp", mode="stop", status="PENDING", path="/nowhere", size_bytes=0,
                        spark_version="4.2.0", stages={}, run_id=run_id, owner="builder"))

    def extensions() -> int:
        return len([e for e in audit.find(settings.database_url, job="clicks") if e.action == "job.lease.extend"])

    with session_scope(settings.database_url) as s:  # a withdrawn stop: nothing to hold
        s.get(Job, "clicks").desired = "RUN"
    assert lease.extend(settings.database_url, "clicks", run_id) is None
    with session_scope(settings.database_url) as s:
        s.get(Job, "clicks").desired = "MOVE"
    with taking._leased(settings, "clicks", "sp", "builder", parked_run=run_id):
        wait_for(lambda: extensions() >= 3 and utcnow() > first_until, 30, "the build outlasting the first lease")
        assert lease.next_action(settings.database_url, "clicks", run_id, hold_a_write_of) == "wait"
    extended = extensions()
    with session_scope(settings.database_url) as s:
        assert as_utc(s.get(JobRun, run_id).lease_until) > first_until
    wait_for(lambda: lease.next_action(settings.database_url, "clicks", run_id, hold_a_write_of) == "resume", 30,
             "the lease running out once the build is over")
    assert extensions() == extended  # not renewed after the build


def test_a_foreach_batch_delivery_outlasts_a_lost_registry_connection(settings: Settings) -> None:
    """The registry's server ends the connection that holds the fence (as a restart or a failover does) while the
    user's function runs: the delivery waits for the registry and delivers the batch again, as its guarantee allows,
    instead of failing the job for good."""
    from changeover.registry.models import SinkLedger
    from changeover.runtime.sinks import WriteContext
    from changeover.runtime.sinks.foreach import deliver
    from sqlalchemy import create_engine, text

    if not settings.database_url.startswith("postgresql"):
        pytest.skip("SQLite has no server connection to lose; the PostgreSQL case is the one that restarts")
    run_id = _job_with_running_run(settings)
    with session_scope(settings.database_url) as s:
        epoch = s.get(JobRun, run_id).epoch
    admin = create_engine(settings.database_url, isolation_level="AUTOCOMMIT")
    calls: list[tuple[list[str], int, int]] = []

    def users_function(batch: list[str], batch_id: int, epoch: int) -> None:
        calls.append((batch, batch_id, epoch))
        if len(calls) == 1:
            with admin.connect() as conn:
                ended = conn.scalar(text("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                                         "WHERE datname = current_database() AND pid <> pg_backend_pid()"))
            assert ended >= 1

    try:
        deliver(users_function, WriteContext(settings.database_url, "clicks", "totals", run_id), ["a", "b"], 3)
    finally:
        admin.dispose()
    assert calls == [(["a", "b"], 3, epoch)] * 2
    with session_scope(settings.database_url) as s:
        assert s.scalar(select(SinkLedger.batch_id).where(SinkLedger.job == "clicks")) == 3


def test_the_epoch_grows_with_every_change_of_ownership_so_a_run_that_reclaims_outranks_its_successor(
        settings: Settings) -> None:
    """A user's function that keeps the newest epoch and refuses older ones (as include/jobs/click_audit.py does)
    never locks its job out: the parked run that takes its job back writes with a larger epoch than the successor
    it fenced, though its run id is smaller."""
    first = _job_with_parked_run(settings, lease_left=0)
    second = _successor(settings)
    # the successor never wrote
    assert lease.next_action(settings.database_url, "clicks", first, hold_a_write_of) == "resume"

    with session_scope(settings.database_url) as s:
        epochs = {run.id: run.epoch for run in s.scalars(select(JobRun))}
        assert s.get(Job, "clicks").epoch == epochs[first]
    with hold(settings.database_url, "clicks", first, "totals", 5) as held:
        assert held.epoch == epochs[first] > epochs[second] and first < second
    with pytest.raises(Fenced):
        write_batch(settings, second)


@contextlib.contextmanager
def _stub_master(settings: Settings, accept: bool, on_submit: Any = None) -> Iterator[None]:
    """A stand-in for the 4.2.0 group's master: its JSON, its REST version and driver status (drivers are KILLED),
    and submissions accepted or refused with HTTP 403 (as a master whose REST key is not Changeover's). A real
    master cannot be made to refuse only the submission, or to forget a driver at will."""
    import http.server
    import json

    class Master42(http.server.BaseHTTPRequestHandler):
        def _answer(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self._answer(200, {"url": "spark://127.0.0.1:1", "status": "ALIVE", "workers": [],
                               "serverSparkVersion": "4.2.0", "driverState": "KILLED"})

        def do_POST(self) -> None:  # noqa: N802
            if on_submit is not None:
                on_submit()
            self._answer(200 if accept else 403, {"success": True, "submissionId": "driver-new",
                                                  "serverSparkVersion": "4.2.0"})

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Master42)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    with session_scope(settings.database_url) as s:
        s.merge(Master(version="4.2.0", host="127.0.0.1", port=1, webui_port=port, rest_port=port, status="RUNNING"))
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


def test_a_standby_whose_launch_failed_is_ended_at_once_not_left_warming(settings: Settings, tmp_path) -> None:
    """The master refuses the submission: the standby's row was written before it, and it is ended with the reason,
    so the move goes cold now instead of after the ready deadline."""
    code = tmp_path / "clicks.py"
    code.write_text("def build(spark, ctx):\n    return []\n")
    live = _job_with_running_run(settings, code=str(code))
    with _stub_master(settings, accept=False), pytest.raises(ChangeoverError, match="refused it with HTTP 403"):
        jobs.launch(settings, LocalCluster(settings), "clicks", "4.2.0", None, Standby(live))
    with session_scope(settings.database_url) as s:
        (standby,) = s.scalars(select(JobRun).where(JobRun.standby_of == live))
        assert standby.ended_at is not None and standby.error.startswith("its launch failed: ")
        assert s.get(Job, "clicks").current_run_id == live


def _killed_mid_move(settings: Settings, tmp_path: Any) -> JobRun:
    code = tmp_path / "clicks.py"
    code.write_text("def build(spark, ctx):\n    return []\n")
    dead = _job_with_running_run(settings, desired="MOVE", code=str(code))
    (tmp_path / "old-checkpoint" / "totals" / "offsets").mkdir(parents=True)
    (tmp_path / "old-checkpoint" / "totals" / "metadata").write_text('{"id":"q"}')  # Spark's, kept at every batch
    with session_scope(settings.database_url) as s:
        run = s.get(JobRun, dead)
        run.state, run.ended_at, run.submission_id = "KILLED", utcnow(), "driver-old"
        run.checkpoint_root, run.error = str(tmp_path / "old-checkpoint"), "lost: no word from its master"
        return run


def test_a_run_declared_dead_is_fenced_before_its_checkpoint_is_copied(settings: Settings, tmp_path) -> None:
    """Its driver may still run (a paused worker): the successor is the job's current run, so the dead run's sink
    writes are refused, before its checkpoint is copied. Before, a batch it wrote between the copy and the hand-over
    passed the fence, and the successor planned that batch id again with other offsets."""
    dead = _killed_mid_move(settings, tmp_path)
    with _stub_master(settings, accept=True):
        new = jobs.launch(settings, LocalCluster(settings), "clicks", "4.2.0", tmp_path / "new-checkpoint",
                          ContinueMove(dead.id), copy_from=dead)
    order = [e.action for e in audit.find(settings.database_url, job="clicks")]
    assert order.index("job.launch.begin") < order.index("job.resubmit") < order.index("job.launch")
    with pytest.raises(Fenced):
        write_batch(settings, dead.id)
    with session_scope(settings.database_url) as s:
        assert s.get(Job, "clicks").current_run_id == new.id


def test_a_continuation_whose_checkpoint_cannot_be_laid_out_hands_the_job_back(settings: Settings, tmp_path) -> None:
    dead = _killed_mid_move(settings, tmp_path)
    (tmp_path / "not-a-folder").write_text("")
    with _stub_master(settings, accept=True), pytest.raises(OSError):
        jobs.launch(settings, LocalCluster(settings), "clicks", "4.2.0", tmp_path / "not-a-folder" / "root",
                    ContinueMove(dead.id), copy_from=dead)
    with session_scope(settings.database_url) as s:
        job = s.get(Job, "clicks")
        assert job.current_run_id == dead.id and job.desired == "MOVE"  # the next try continues it again
        (failed,) = s.scalars(select(JobRun).where(JobRun.id != dead.id))
        assert failed.state == "FAILED" and failed.error.startswith("its launch failed before a driver ran")


def test_a_continuation_refused_by_its_master_hands_the_job_back_and_a_stop_asked_meanwhile_stands(
        settings: Settings, tmp_path) -> None:
    dead = _killed_mid_move(settings, tmp_path)
    with _stub_master(settings, accept=False), pytest.raises(ChangeoverError, match="HTTP 403"):
        jobs.launch(settings, LocalCluster(settings), "clicks", "4.2.0", tmp_path / "new", ContinueMove(dead.id),
                    copy_from=dead)
    with session_scope(settings.database_url) as s:
        job = s.get(Job, "clicks")
        assert (job.current_run_id, job.desired) == (dead.id, "MOVE")

    def users_stop() -> None:  # asked while the retry's submission is on its way
        with session_scope(settings.database_url) as s:
            s.get(Job, "clicks").desired = "STOP"

    with _stub_master(settings, accept=False, on_submit=users_stop), pytest.raises(ChangeoverError):
        jobs.launch(settings, LocalCluster(settings), "clicks", "4.2.0", tmp_path / "newer", ContinueMove(dead.id),
                    copy_from=dead)
    with session_scope(settings.database_url) as s:
        assert (s.get(Job, "clicks").current_run_id, s.get(Job, "clicks").desired) == (dead.id, "STOP")


def test_a_layout_cut_short_is_never_taken_for_a_checkpoint(settings: Settings, tmp_path) -> None:
    """The task laying out a dead run's checkpoint is killed mid-copy: the next continuation copies from the
    checkpoint that one was copied from, not from the half-copied folder (whose missing stages would start over)."""
    dead = _killed_mid_move(settings, tmp_path)
    half = tmp_path / "half-copied"
    half.mkdir()
    (half / jobs.LAYING_OUT).write_text(dead.checkpoint_root)  # as a copy killed before its end leaves it
    with session_scope(settings.database_url) as s:
        s.get(JobRun, dead.id).checkpoint_root = str(half)
        dead = s.get(JobRun, dead.id)
    with _stub_master(settings, accept=True):
        jobs.launch(settings, LocalCluster(settings), "clicks", "4.2.0", tmp_path / "next", ContinueMove(dead.id),
                    copy_from=dead)
    assert (tmp_path / "next" / "totals" / "metadata").exists() and not (tmp_path / "next" / jobs.LAYING_OUT).exists()


def test_a_launch_still_laying_out_its_checkpoint_is_not_taken_for_never_accepted(
        settings: Settings, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A large state copies slowly: the run has no submission id yet, and its silence passes the loss deadline, but
    it is not ended while its root is marked; once the marker is gone (a copy cut short never removes it, and the
    next continuation copies from the source), the deadline applies again."""
    from changeover.jobs.observing import _unaccepted

    monkeypatch.setenv("CHANGEOVER_LOST_AFTER_SECONDS", "0")
    run_id = _job_with_running_run(settings)
    root = tmp_path / "laying-out"
    root.mkdir()
    (root / jobs.LAYING_OUT).write_text("/elsewhere")
    with session_scope(settings.database_url) as s:
        run = s.get(JobRun, run_id)
        run.state, run.checkpoint_root, run.submitted_at = "SUBMITTED", str(root), utcnow() - timedelta(hours=1)
    with session_scope(settings.database_url) as s:
        _unaccepted(s, s.get(JobRun, run_id))
    with session_scope(settings.database_url) as s:
        assert s.get(JobRun, run_id).ended_at is None
    (root / jobs.LAYING_OUT).unlink()
    with session_scope(settings.database_url) as s:
        _unaccepted(s, s.get(JobRun, run_id))
    with session_scope(settings.database_url) as s:
        assert s.get(JobRun, run_id).state == "KILLED"


def test_a_parked_run_gives_up_on_a_registry_that_answers_no_or_never_answers(
        settings: Settings, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A registry that refuses the driver (here its database is gone: a refused password or a read-only database
    never clear either) ends the parked run's wait at once; one that does not answer (nothing listens) ends it
    after the registry's patience. Either way the driver ends and frees its cores instead of holding them, and
    leaves its reason beside its checkpoint for the control plane's `job.end`."""
    import socket

    from changeover.registry import db
    from changeover.runtime import checkpoints
    from changeover.runtime.loop import Driver, GaveUp

    if settings.database_url.startswith("postgresql"):
        refusing = settings.database_url.rsplit("/", 1)[0] + "/no_such_registry"
    else:
        (tmp_path / "folder.db").mkdir()  # SQLite cannot open a folder as its database, whatever it retries
        refusing = f"sqlite:///{tmp_path / 'folder.db'}"
    closed = socket.socket()  # bound, never listening, held for the test: connections to it are refused
    closed.bind(("127.0.0.1", 0))
    silent = f"postgresql+psycopg://nobody@127.0.0.1:{closed.getsockname()[1]}/registry"

    def parked_on(url: str) -> Any:
        return Driver(Settings.from_env(home=tmp_path / "home", database_url=url), "clicks", 1, 60)

    refused, root = parked_on(refusing), tmp_path / "refused-checkpoint"
    root.mkdir()
    with pytest.raises(GaveUp, match="the registry refused it"):
        refused._next_action(root)
    assert (checkpoints.read_gave_up(root) or "").startswith("parked, it gave up its lease and ended after 0 s: "
                                                             "the registry refused it (")
    monkeypatch.setattr(db, "REGISTRY_PATIENCE_SECONDS", 1.0)
    unanswered, root = parked_on(silent), tmp_path / "unanswered-checkpoint"
    root.mkdir()
    started = time.monotonic()
    try:
        with pytest.raises(GaveUp, match="the registry did not answer"):
            while unanswered._next_action(root) == "wait":
                time.sleep(0.05)
    finally:
        closed.close()
    assert time.monotonic() - started >= 1.0  # it waited first: a restart would have cleared
    assert "the registry did not answer" in (checkpoints.read_gave_up(root) or "")


def test_a_successor_whose_write_only_the_sinks_own_database_holds_is_not_undone_by_a_reclaim(
        settings: Settings, tmp_path: Path, pg_database: Any) -> None:
    """A keyed table in another database commits before the registry records the write (first_write_at). The
    successor died between the two: the registry says it wrote nothing and ended, which used to make the parked
    run reclaim the job and skip, as already in the ledger, a batch id it planned with other offsets. The lease
    reads the sink's own ledger: the successor wrote, so the parked run leaves the job to the successor's
    checkpoint."""
    from changeover.registry.models import SinkLedger
    from changeover.registry.schema import migrate
    from changeover.runtime import KeyedTable
    from sqlalchemy import create_engine

    elsewhere = (pg_database("changeover_sink") if settings.database_url.startswith("postgresql")
                 else f"sqlite:///{tmp_path / 'users.db'}")
    migrate(elsewhere)  # the sink's ledger table, as its first merge creates it
    old = _job_with_parked_run(settings, lease_left=3600)  # parked at batch 4 of stage totals
    with session_scope(settings.database_url) as s:
        s.get(JobRun, old).sinks = {"totals": KeyedTable(elsewhere, "totals", keys=("key",)).describe()}
    new = _successor(settings)
    with session_scope(settings.database_url) as s:
        successor = s.get(JobRun, new)
        successor.state, successor.ended_at = "KILLED", utcnow()  # died after the sink's commit
    engine = create_engine(elsewhere)

    def ledger_row(batch: int, run: int) -> None:
        with engine.begin() as connection:
            connection.execute(SinkLedger.__table__.insert().values(
                job="clicks", stage="totals", batch_id=batch, rows=1, run_id=run, written_at=utcnow()))

    try:
        ledger_row(90, old - 1)  # an earlier run's batch (another timeline): says nothing about the successor
        with session_scope(settings.database_url) as s:
            s.get(JobRun, old).lease_until = utcnow() + timedelta(hours=1)
        _reclaimed_then_parked_again(settings, old, new, "totals")
        ledger_row(5, new)  # the successor's batch, committed in the sink's database only
    finally:
        engine.dispose()

    _left_to_its_successor(settings, old, new)
