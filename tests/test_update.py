"""The code update's registry steps (SQLite and PostgreSQL): a running driver keeps its code, a switch is
recorded once, and a rollback leaves a job alone that still runs its old code.

The runs are registry rows; the update_job DAG drives the same steps through real drivers end to end
(tests/e2e)."""

from __future__ import annotations

from pathlib import Path

import pytest
from changeover import audit
from changeover.cluster import LocalCluster
from changeover.cluster.shipping import store_job_code
from changeover.errors import ChangeoverError
from changeover.registry.db import session_scope
from changeover.registry.models import Job, JobRun, Savepoint, utcnow
from changeover.settings import Settings
from changeover.upgrade import code_update, zero_downtime

JOB_CODE = "from changeover.runtime import Stage\n\n\ndef build(spark, ctx):\n    return []\n"


def _job(settings: Settings, tmp_path: Path, state: str) -> dict[str, str]:
    old = tmp_path / "team" / "v1" / "orders.py"
    old.parent.mkdir(parents=True)
    old.write_text(JOB_CODE)
    shipped = store_job_code(settings, "orders", str(old))
    with session_scope(settings.database_url) as s:
        s.add(Job(name="orders", module=shipped.module, code=str(shipped.artifact), entry=shipped.entry,
                  fault_tolerant=True, block_shutdown=False, options={}))
        s.flush()
        run = JobRun(job="orders", spark_version="4.2.0", master_url="spark://x", state=state, progress={},
                     ended_at=None if state == "RUNNING" else utcnow())
        s.add(run)
        s.flush()
        s.get(Job, "orders").current_run_id = run.id
    return code_update.current_code(settings, "orders")


def _new_code(tmp_path: Path) -> str:
    new = tmp_path / "team" / "v2" / "orders.py"
    new.parent.mkdir(parents=True)
    new.write_text(JOB_CODE + "# v2\n")
    return str(new)


def test_a_running_job_keeps_its_code_until_it_is_stopped(settings: Settings, tmp_path: Path) -> None:
    old = _job(settings, tmp_path, "RUNNING")
    new = _new_code(tmp_path)
    with pytest.raises(ChangeoverError, match=r"code change of job orders: its run \d+ is still RUNNING.*stop the job"):
        code_update.switch_code(settings, "orders", new, "test")
    assert code_update.current_code(settings, "orders") == old
    with session_scope(settings.database_url) as s:
        run = s.get(JobRun, s.get(Job, "orders").current_run_id)
        run.state, run.ended_at = "STOPPED", utcnow()
    assert code_update.switch_code(settings, "orders", new, "test") is True
    assert code_update.switch_code(settings, "orders", new, "test") is False  # a retried task changes nothing
    switched = code_update.current_code(settings, "orders")
    assert switched["code"] != old["code"] and switched["code"].endswith("orders.py")
    assert Path(switched["code"]).read_text().endswith("# v2\n")
    changes = [e for e in audit.find(settings.database_url, job="orders") if e.action == "job.update_code"]
    assert [(e.details["before"], e.details["after"]) for e in changes] == [(old["code"], switched["code"])]
    assert code_update.switch_code(settings, "orders", old, "back") is True  # the shipped form, as a rollback has it
    assert code_update.current_code(settings, "orders") == old


def test_a_rollback_leaves_a_job_that_still_runs_its_old_code(settings: Settings, tmp_path: Path) -> None:
    old = _job(settings, tmp_path, "RUNNING")
    assert code_update.rollback(settings, LocalCluster(settings), "orders", old, "update-x", "the check failed") is None
    assert not [e for e in audit.find(settings.database_url, job="orders") if e.action == "job.rollback"]


def test_an_updates_strategy_is_asked_or_the_jobs_option_and_an_unknown_one_is_refused() -> None:
    assert code_update.strategy_of(None, {}) == "stop"
    assert code_update.strategy_of(None, {"move_strategy": "zero_downtime"}) == "zero_downtime"
    assert code_update.strategy_of("stop", {"move_strategy": "zero_downtime"}) == "stop"  # the Param wins
    with pytest.raises(ChangeoverError, match=r"update strategy 'blue_green'.*stop, zero_downtime.*pick one"):
        code_update.strategy_of("blue_green", {})


@pytest.mark.parametrize(("refused", "resumed", "stable", "rolled_back", "old_runs", "said"), [
    (True, False, False, False, True, "stopped at the check"),
    (False, False, False, False, True, "not resumed: the job runs its old code"),  # a follower out of time, say
    (False, False, False, False, False, "failed: the job is not running its old code"),  # stopped, resume failed
    (False, True, True, False, False, "updated"),
    (False, True, False, True, True, "rolled back"),
    (False, True, False, False, False, "failed: the job is not running its old code"),  # gate and rollback failed
    (False, True, False, False, True, "failed"),  # the gate failed, the rollback found the old code running
])
def test_an_updates_outcome_says_where_it_ended(refused: bool, resumed: bool, stable: bool, rolled_back: bool,
                                                old_runs: bool, said: str) -> None:
    assert code_update.outcome(refused, resumed, stable, rolled_back, old_runs).startswith(said)


@pytest.mark.parametrize(("renames", "drops", "partitions", "why"), [
    ({"totals": "sums"}, False, None, "it renames stages (totals -> sums)"),
    ({}, True, None, "it drops state (allow_non_restored_state)"),
    ({}, False, 8, "it repartitions the state (state_partitions 8)"),
    ({}, False, None, None),
])
def test_a_zero_downtime_update_needs_every_stage_kept_as_it_is(renames: dict[str, str], drops: bool,
                                                                partitions: int | None, why: str | None) -> None:
    """Its follower replays the running job's batches on the new code: a stage renamed, dropped or repartitioned
    has no batches of the running job to replay."""
    assert code_update.zero_downtime_refusal(renames, drops, partitions) == why


def test_a_zero_downtime_update_that_cannot_be_is_refused_before_anything_is_touched(settings: Settings,
                                                                                   tmp_path: Path) -> None:
    _job(settings, tmp_path, "RUNNING")
    with pytest.raises(ChangeoverError, match="zero-downtime update of job orders: it renames stages.*strategy stop"):
        code_update.cut_over(settings, None, "orders", _new_code(tmp_path), "update-x",  # type: ignore[arg-type]
                             zero_downtime.CatchUp(), renames={"totals": "sums"})


def test_the_gate_fails_at_once_when_the_run_of_its_savepoint_has_the_job_again(settings: Settings,
                                                                                tmp_path: Path) -> None:
    """A zero-downtime update's follower failed on its first write after the cut-over, and the parked run took the
    job back: that run commits on, on the old code, and must not pass for the new code."""
    _job(settings, tmp_path, "RUNNING")
    with session_scope(settings.database_url) as s:
        run = s.get(Job, "orders").current_run_id
        live = s.get(JobRun, run)
        live.progress, live.last_commit_at = {"totals": 40}, utcnow()
        s.add(Savepoint(job="orders", name="update-x", mode="stop", status="COMPLETED", path=str(tmp_path),
                        size_bytes=0, spark_version="4.2.0", stages={"totals": 30}, run_id=run))
    result = code_update.stability(settings, None, "orders", "update-x", 5, 60)  # type: ignore[arg-type]
    assert (result.stable, result.ended, result.run) == (False, True, run)
    assert "runs the job again: the run of the new code ended before it wrote anything" in result.reason
