"""A move's paths that real-Spark cases under `make test-e2e` (marked long) take, here over the fake fleet
(tests/fake_fleet.py) and the real registry, on SQLite and PostgreSQL, without Spark: `relocate.step` launches its
standbys through the fake 4.3.0 master and takes its savepoints of checkpoint files in Spark's layout, and each test
plays the drivers' part in the registry with the runtime's own functions (a standby says it is ready, a run parks at
its boundary, a live run commits on).

- A warm move's standby killed before the hand-over: the move goes cold, the job never asked to stop for the warm try
  (tests/test_user_jobs.py::test_a_standby_killed_before_the_hand_over_leaves_the_job_running_and_the_move_goes_cold).
- The rolling upgrade's own move_strategy Param, through RollingUpgradeOperator, the roll and the drain, to each move
  (tests/e2e/test_airflow_upgrade.py::test_a_zero_downtime_roll_through_the_scheduler_moves_the_job_once_...).
- A zero-downtime follower out of time: aborted and its checkpoint removed, the live run never asked to stop
  (tests/test_user_jobs.py::test_a_follower_too_slow_to_catch_up_is_aborted_and_the_live_run_never_stops).
"""

from __future__ import annotations

import copy
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from airflow.sdk.exceptions import TaskDeferred
from changeover import audit, jobs
from changeover.handoff import lease
from changeover.jobs import move_history
from changeover.registry.db import session_scope
from changeover.registry.models import Job, JobRun, Member, UpgradeRun, utcnow
from changeover.settings import Settings
from changeover.upgrade import lock, relocate, roll, warm
from changeover.upgrade.zero_downtime import CatchUp, CatchUpTimedOut
from fake_fleet import FakeFleet, FakeMaster
from sqlalchemy import select
from test_follower_decisions import batch as spark_batch

CHECKOUT = Path(__file__).resolve().parents[1]
JOB_CODE = "def build(spark, ctx):\n    return []\n"
STAGE = "totals"
COMMITTED = 5  # batches 0-4, committed by the live run before its move


def _free_cores(monkeypatch: pytest.MonkeyPatch, master: FakeMaster, cores: int) -> None:
    """Each of the fake master's workers reports `cores` free, as a real master's JSON says them (`coresfree`): room
    for a standby's driver and executor (`placement.CORES_PER_JOB`), which a move looks for before it launches one."""
    state = master.state

    def with_cores() -> dict[str, Any]:
        said = state()
        return {**said, "workers": [{**worker, "coresfree": cores} for worker in said["workers"]]}

    monkeypatch.setattr(master, "state", with_cores)


@pytest.fixture
def fleet(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> FakeFleet:
    """m1 and m2 at 4.2.0 and m3 at 4.3.0, as test_user_jobs.py's cluster, each worker with 4 cores free."""
    fleet = FakeFleet(settings)
    fleet.up([("m1", "4.2.0"), ("m2", "4.2.0"), ("m3", "4.3.0")])
    for master in fleet.masters.values():
        _free_cores(monkeypatch, master, 4)
    return fleet


def _commit(stage: Path, batches: range) -> None:
    """Batches committed in a stage checkpoint now, each having read one input file."""
    for n in batches:
        spark_batch(stage, n, n, {n: time.time()}, time.time())


def _running_job(fleet: FakeFleet, tmp_path: Path, name: str) -> int:
    """A fault-tolerant job whose current run's driver runs on m1 (4.2.0), with batches 0-4 committed in its
    checkpoint, its foreachBatch sink declared (idempotent) and its code a file a launch ships. Returns the run's id."""
    settings = fleet.settings
    code = tmp_path / f"{name}.py"
    code.write_text(JOB_CODE)
    root = tmp_path / f"{name}-checkpoint"
    _commit(root / STAGE, range(COMMITTED))
    submission = fleet.master("4.2.0").create({"appArgs": []})
    with session_scope(settings.database_url) as s:
        fleet.driver(submission).host = s.get(Member, "m1").host
        s.add(Job(name=name, module=name, code=str(code), entry="build", fault_tolerant=True, block_shutdown=False,
                  options={}))
        s.flush()
        now = utcnow()
        run = JobRun(job=name, spark_version="4.2.0", master_url="spark://fake-4.2.0:7077", state="RUNNING",
                     progress={STAGE: COMMITTED - 1}, member="m1", submission_id=submission, heartbeat_at=now,
                     first_commit_at=now, last_commit_at=now, checkpoint_root=str(root),
                     sinks={STAGE: {"kind": "foreach", "guarantee": "idempotent"}})
        s.add(run)
        s.flush()
        s.get(Job, name).make_current(run)
        return run.id


def _standbys(settings: Settings, run_id: int) -> list[JobRun]:
    """Every standby ever launched for the run, ended or not, oldest first."""
    with session_scope(settings.database_url) as s:
        return list(s.scalars(select(JobRun).where(JobRun.standby_of == run_id).order_by(JobRun.id)))


def _actions(settings: Settings, job: str) -> list[str]:
    return [e.action for e in audit.find(settings.database_url, job=job)]


def _desired(settings: Settings, job: str) -> str:
    with session_scope(settings.database_url) as s:
        return s.get(Job, job).desired


def test_a_standby_killed_before_the_hand_over_leaves_the_job_running_and_the_move_goes_cold(
        fleet: FakeFleet, tmp_path: Path) -> None:
    """test_user_jobs.py's case of this name, its decisions without Spark: the warm move's standby on 4.3.0 is killed
    while the job still runs on 4.2.0. The next look at the move finds no standby to wait for and says why it goes
    cold, naming the standby; the job was never asked to stop for the warm try, and no second standby is launched.
    The move then goes on cold: the stop at a boundary, its savepoint, and a successor from it that was no standby."""
    settings, url = fleet.settings, fleet.settings.database_url
    first = _running_job(fleet, tmp_path, "fallback")
    assert not relocate.step(settings, fleet, "fallback", "4.3.0", reason="upgrade")  # its standby launched
    (standby,) = _standbys(settings, first)
    assert standby.spark_version == "4.3.0" and standby.submission_id and standby.ended_at is None
    assert _desired(settings, "fallback") == "RUN"
    fleet.master("4.3.0").kill(str(standby.submission_id))  # its driver dies before it is ready
    assert jobs.observe(settings, fleet, standby.id).state == "KILLED"
    running = jobs.refresh(settings, fleet, "fallback")
    assert running is not None and (running.id, running.state, running.parks) == (first, "RUNNING", 0)

    assert warm.prepare(settings, fleet, "fallback", running, "4.3.0", leaving_member=False) == "cold"
    cold = [e.details for e in audit.find(url, job="fallback") if e.action == "job.move.cold"]
    assert len(cold) == 1 and (cold[0]["run"], cold[0]["version"]) == (first, "4.3.0"), cold
    assert f"its standby run {standby.id} ended KILLED" in cold[0]["reason"], cold
    assert _desired(settings, "fallback") == "RUN"  # never asked to stop: it runs on where it is
    assert "job.request_stop" not in _actions(settings, "fallback")
    assert len(_standbys(settings, first)) == 1

    # The move goes on cold: its stop is asked at once, with no standby to wait for ...
    assert not relocate.step(settings, fleet, "fallback", "4.3.0", reason="upgrade")
    assert _desired(settings, "fallback") == "MOVE" and len(_standbys(settings, first)) == 1
    # ... the driver parks at its boundary (played here), and a cold successor starts from the stop's savepoint
    lease.park(url, "fallback", first, {STAGE: COMMITTED - 1}, seconds=3600)
    assert relocate.step(settings, fleet, "fallback", "4.3.0", reason="upgrade")
    successor = jobs.refresh(settings, fleet, "fallback")
    assert successor is not None and successor.id != first and successor.spark_version == "4.3.0"
    assert successor.standby_of is None and successor.from_savepoint == f"upgrade-run{first}-stop1"
    assert "job.hand_over" not in _actions(settings, "fallback")
    with session_scope(url) as s:  # its first commit, as its driver records it
        s.get(JobRun, successor.id).first_commit_at = utcnow()
    assert [(m.from_run, m.warm) for m in move_history.of(settings, "fallback")] == [(first, False)]


RUN_ID = "manual__moves"
KEY = f"rolling_upgrade/{RUN_ID}"  # the upgrade is its DAG run (`operators.base.upgrade_key`)


def _roll_task(strategy: str | None) -> tuple[Any, dict[str, Any]]:
    """The rolling_upgrade DAG's roll task, its templates rendered as Airflow renders them for a run, with that run's
    Params: the DAG's defaults, and move_strategy as the trigger form set it (None: left at its default)."""
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(CHECKOUT / "dags" / "rolling_upgrade.py"), safe_mode=False)
    assert bag.import_errors == {}
    dag = bag.dags["rolling_upgrade"]
    params = copy.deepcopy(dag.params)
    if strategy is not None:
        params["move_strategy"] = strategy  # checked against the Param's enum, as the trigger form's value is
    resolved = params.validate()
    task = dag.get_task("roll")
    assert task.move_strategy == "{{ params.move_strategy }}"
    task.render_template_fields({"params": resolved})
    return task, resolved


def _parks_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A warm move waits for the live run to park once its stop is asked: the run's driver parks at its boundary as
    soon as it is asked (played here, with the runtime's own `lease.park`), and the real wait sees it parked."""
    wait = warm.wait_parked

    def parked_at_once(settings: Settings, job_name: str, run_id: int, seconds: float) -> bool:
        lease.park(settings.database_url, job_name, run_id, {STAGE: COMMITTED - 1}, seconds=3600)
        return wait(settings, job_name, run_id, seconds)

    monkeypatch.setattr(warm, "wait_parked", parked_at_once)


@pytest.mark.parametrize(("asked", "follows"), [("zero_downtime", True), (None, False)],
                         ids=["zero_downtime", "warm by default"])
def test_the_rolling_upgrades_move_strategy_param_reaches_the_moves_of_its_drains(
        fleet: FakeFleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, asked: str | None, follows: bool) -> None:
    """The path the e2e zero-downtime roll through the scheduler takes, without Spark and Airflow's scheduler: the
    DAG's move_strategy Param, rendered into RollingUpgradeOperator, recorded with the upgrade by `roll.step`
    (`zero_downtime.record_for_upgrade`), read back by the drain (`zero_downtime.for_upgrade`) and passed to each
    `relocate.step`. m1's job gets a standby on 4.3.0; once it is ready, zero_downtime gives it a checkpoint of its
    own to follow the live run read-only (`job.follow.start`), the job not asked to stop; the Param's default, warm,
    asks the stop at once and hands the job to the standby, which never followed."""
    settings, url = fleet.settings, fleet.settings.database_url
    task, params = _roll_task(asked)
    assert task.move_strategy == (asked or "warm")
    monkeypatch.setattr(task, "_setup", lambda context: (settings, fleet))
    _parks_when_asked(monkeypatch)
    first = _running_job(fleet, tmp_path, "clicks")
    lock.begin(settings, KEY, "4.3.0", {"m1": "4.2.0", "m2": "4.2.0"})  # what preflight leaves
    roll.start(settings, KEY, ["m1", "m2"])
    ti = SimpleNamespace(dag_id="rolling_upgrade", run_id=RUN_ID, task_id="roll", try_number=1)
    context = {"params": params, "ti": ti, "task_instance": ti, "dag_run": None}

    with pytest.raises(TaskDeferred):  # m1 drains: its job's standby starts on 4.3.0, and the task waits
        task.execute(context)
    (standby,) = _standbys(settings, first)
    assert standby.spark_version == "4.3.0" and standby.ended_at is None
    with session_scope(url) as s:
        assert s.scalar(select(UpgradeRun).where(UpgradeRun.key == KEY)).progress["moves"]["strategy"] == (
            asked or "warm")
    assert lease.mark_ready(url, standby.id, None)  # its driver has its session, an executor and its plans
    with pytest.raises(TaskDeferred):  # the trigger woke the task: the drain's next step of the move
        task.execute(context)

    events = audit.find(url, job="clicks")
    actions = [e.action for e in events]
    current = jobs.refresh(settings, fleet, "clicks")
    assert current is not None
    if follows:
        started = [e.details for e in events if e.action == "job.follow.start"]
        assert [(d["run"], d["follows"]) for d in started] == [(standby.id, first)], started
        follower = jobs.observe(settings, fleet, standby.id)
        assert follower.following_since is not None and Path(str(follower.checkpoint_root)).is_dir()
        assert "job.request_stop" not in actions and "job.hand_over" not in actions, actions
        assert (current.id, current.state, _desired(settings, "clicks")) == (first, "RUNNING", "RUN")
    else:
        assert "job.follow.start" not in actions and "job.request_stop" in actions, actions
        handed = [e.details for e in events if e.action == "job.hand_over"]
        assert [(d["run"], d["replaces"]) for d in handed] == [(standby.id, first)], handed
        assert current.id == standby.id and current.following_since is None


def test_a_follower_too_slow_to_catch_up_is_aborted_and_the_live_run_never_stops(
        fleet: FakeFleet, tmp_path: Path) -> None:
    """test_user_jobs.py's case of this name, its decisions without Spark: a zero-downtime move's follower on 4.3.0
    replays one batch while the live run commits five, and its catch-up (20 s) runs out. The move's next step ends
    the follower (STOPPED, its driver killed), removes its checkpoint and raises `CatchUpTimedOut`, saying the job
    was never stopped; the live run was never asked to stop and runs on, its own checkpoint untouched."""
    settings, url = fleet.settings, fleet.settings.database_url
    first = _running_job(fleet, tmp_path, "tooslow")
    live_stage = tmp_path / "tooslow-checkpoint" / STAGE

    def step() -> bool:
        return relocate.step(settings, fleet, "tooslow", "4.3.0", reason="upgrade", strategy="zero_downtime",
                             catch_up=CatchUp(seconds=20))

    assert not step()  # its standby launched on 4.3.0
    (standby,) = _standbys(settings, first)
    assert lease.mark_ready(url, standby.id, None)
    assert not step()  # given its own checkpoint, a continue savepoint of the live run restored: it follows
    follower = jobs.observe(settings, fleet, standby.id)
    assert follower.following_since is not None and follower.checkpoint_root
    checkpoint = Path(follower.checkpoint_root)
    assert (checkpoint / STAGE / "commits" / str(COMMITTED - 1)).exists()
    _commit(live_stage, range(COMMITTED, COMMITTED + 5))  # the live run commits on: batches 5-9
    _commit(checkpoint / STAGE, range(COMMITTED, COMMITTED + 1))  # its follower, slow on 4.3.0, replays batch 5
    with session_scope(url) as s:  # and its 20 s are up
        s.get(JobRun, standby.id).following_since = utcnow() - timedelta(seconds=30)

    with pytest.raises(CatchUpTimedOut, match=r"was still .* behind the live run .* the job was never stopped") as \
            refused:
        step()
    assert f"{{'{STAGE}': 4}} batch(es) behind the live run {first}" in str(refused.value)
    assert f"it runs on as run {first}" in str(refused.value)
    actions = _actions(settings, "tooslow")
    assert "job.follow.start" in actions and "job.move.zero_downtime.abort" in actions, actions
    assert "job.request_stop" not in actions and "job.park" not in actions, actions
    run = jobs.refresh(settings, fleet, "tooslow")
    assert run is not None and (run.id, run.state, run.parks) == (first, "RUNNING", 0)
    assert _desired(settings, "tooslow") == "RUN"
    (ended,) = _standbys(settings, first)
    assert ended.state == "STOPPED" and ended.ended_at is not None and ended.following_since is not None
    assert fleet.driver(str(ended.submission_id)).state == "KILLED"  # its driver ended before the removal
    assert not checkpoint.exists(), "the follower's checkpoint was not removed"
    aborted = [e.details for e in audit.find(url, job="tooslow") if e.action == "job.move.zero_downtime.abort"]
    assert [(d["run"], d["checkpoint_removed"]) for d in aborted] == [(standby.id, str(checkpoint))], aborted
    assert (live_stage / "commits" / str(COMMITTED + 4)).exists()  # the live run's own checkpoint is whole
