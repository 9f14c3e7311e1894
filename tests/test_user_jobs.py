"""Users' own PySpark jobs under Changeover, on a real cluster: the guide's windowed count from a file outside the
checkout writing parquet, a stream-stream join into a keyed table, and a job writing through its own foreachBatch
function. Each is moved from Spark 4.2.0 to 4.3.0 the way a rolling upgrade moves it (stop at a boundary,
savepoint, resume on the new group) and ends exact against ground truth the test computes itself.
"""

from __future__ import annotations

import json
import shutil
import threading
import zipfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest
from changeover import audit, faults, jobs, savepoints
from changeover.cli.generator import Generator
from changeover.cluster import LocalCluster, wait_for
from changeover.cluster.spark_settings import SparkSettings
from changeover.errors import ChangeoverError
from changeover.jobs import move_history
from changeover.registry.db import session_scope
from changeover.registry.models import JobRun, SinkLedger
from changeover.runtime import KeyedTable
from changeover.runtime.sinks.files import LOG, log_entries
from changeover.settings import Settings
from changeover.upgrade import drain, relocate, warm
from changeover.upgrade.zero_downtime import CatchUp
from conftest import ONE_REGISTRY, TRIGGER, feeding, registry_settings
from guide_words import GUIDE_JOB, Words, parquet_counts
from jobs import click_audit, click_joins, clicks
from sqlalchemy import func, select

pytestmark = pytest.mark.slow
USER_JOBS = Path(__file__).parent / "user_jobs"


@dataclass
class Cluster:
    settings: Settings
    cluster: LocalCluster
    kind: str
    pg_database: object


@pytest.fixture(scope="module", params=ONE_REGISTRY)
def live(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, pg_database) -> Iterator[Cluster]:
    home = tmp_path_factory.mktemp(f"user-jobs-{request.param}")
    settings = registry_settings(request.param, home, pg_database, "changeover_uj")
    cluster = LocalCluster(settings)
    try:
        cluster.up([("m1", "4.2.0"), ("m2", "4.2.0"), ("m3", "4.3.0")])  # jobs start on the larger 4.2.0 group
        yield Cluster(settings, cluster, request.param, pg_database)
    finally:
        cluster.down()


@pytest.fixture(autouse=True)
def no_job_left_running(live: Cluster) -> Iterator[None]:
    """A failed test leaves no driver holding the members' cores for the next one."""
    yield
    for job in jobs.list_jobs(live.settings):
        if job["state"] in jobs.LIVE:
            jobs.cancel(live.settings, live.cluster, job["name"], reason="test cleanup")


def move_to(live: Cluster, job: str, version: str) -> None:
    """What the roll does for each fault-tolerant job on a drained member, one idempotent step at a time.
    The job needs new input meanwhile: its first batch on the new version is what this waits for."""
    wait_for(lambda: relocate.step(live.settings, live.cluster, job, version, reason="upgrade"), 240,
             f"{job} moving to Spark {version}")
    assert jobs.refresh(live.settings, live.cluster, job).spark_version == version
    jobs.wait_until_committed(live.settings, live.cluster, job)


def test_the_guides_windowed_count_from_a_file_outside_the_checkout_moves_exact(live: Cluster,
                                                                                tmp_path: Path) -> None:
    outside = tmp_path / "team-repo" / "guide_windowed_counts.py"  # not under the checkout, not on any path
    outside.parent.mkdir()
    shutil.copy(GUIDE_JOB, outside)
    words, output = Words(tmp_path / "words"), tmp_path / "out" / "counts"
    for _ in range(12):
        words.write()
    jobs.submit(live.settings, live.cluster, str(outside), "guide",
                options={"words": str(words.folder), "output": str(output)})
    jobs.wait_until_committed(live.settings, live.cluster, "guide")
    older = savepoints.take(live.settings, "guide", "older", mode="continue")
    for _ in range(12):
        words.write()
    with words.writing():
        move_to(live, "guide", "4.3.0")
    assert [m.warm for m in move_history.of(live.settings, "guide")] == [True]  # a standby was ready before the stop
    for _ in range(12):
        words.write()
    words.flush()
    truth = words.truth()
    wait_for(lambda: parquet_counts(output) == truth, 300, "every closed window in the parquet output")

    # An older savepoint: the file sink's log is ahead of it, and Spark would skip the replayed batches.
    savepoints.request_stop(live.settings, "guide", reason="test")
    wait_for(lambda: jobs.refresh(live.settings, live.cluster, "guide").state == "STOPPED", 120, "guide stopping")
    with pytest.raises(ChangeoverError, match=r"the files sink of stage windowed_counts is ahead of the savepoint"):
        jobs.resume(live.settings, live.cluster, "guide", "older")
    jobs.resume(live.settings, live.cluster, "guide", "older", rewind_sink=True)
    assert max(int(p.name.removesuffix(".compact")) for p in (output / LOG).iterdir()) == older.stages[
        "windowed_counts"], "the log was trimmed to the savepoint's batch"
    wait_for(lambda: parquet_counts(output) == truth, 300, "the rewound output exact again")
    jobs.cancel(live.settings, live.cluster, "guide", reason="test finished with it")


def test_a_job_with_no_input_yet_reports_its_first_trigger_and_commits_nothing(live: Cluster, tmp_path: Path) -> None:
    """What a drain waits on before restarting a member a job moved off: its first batch on the new run, or, for a
    job with no input, its first trigger; either ends the wait (`drain._first_batch_pending`)."""
    words = Words(tmp_path / "words")  # an empty folder
    run = jobs.submit(live.settings, live.cluster, str(GUIDE_JOB), "idle",
                      options={"words": str(words.folder), "output": str(tmp_path / "out")})
    wait_for(lambda: jobs.observe(live.settings, live.cluster, run.id).first_trigger_at is not None, 240,
             "the idle job's first trigger")
    seen = jobs.observe(live.settings, live.cluster, run.id)
    assert seen.state == "RUNNING" and seen.first_commit_at is None
    words.write()
    jobs.wait_until_committed(live.settings, live.cluster, "idle")
    assert jobs.observe(live.settings, live.cluster, run.id).first_trigger_at == seen.first_trigger_at  # set once
    jobs.cancel(live.settings, live.cluster, "idle", reason="test finished with it")


def test_a_join_into_a_keyed_table_and_a_foreach_batch_job_move_exact_and_survive_a_kill(live: Cluster,
                                                                                        tmp_path: Path) -> None:
    generator = Generator(tmp_path / "landing")
    audit_url = (f"sqlite:///{tmp_path / 'team-audit.db'}" if live.kind == "sqlite"
                 else live.pg_database("team_audit"))  # type: ignore[operator]
    generator.write_file()
    generator.start(interval=0.5)
    try:
        jobs.submit(live.settings, live.cluster, "jobs.click_joins", "joins",
                    options={"landing": str(generator.landing), "trigger": TRIGGER})
        jobs.submit(live.settings, live.cluster, "jobs.click_audit", "audit",
                    options={"landing": str(generator.landing), "audit_url": audit_url, "trigger": TRIGGER})
        for job in ("joins", "audit"):
            jobs.wait_until_committed(live.settings, live.cluster, job)
        for job in ("joins", "audit"):
            move_to(live, job, "4.3.0")
        # Killed, not stopped: the resubmitted job continues from the killed run's checkpoint.
        jobs.cancel(live.settings, live.cluster, "joins", reason="test kills it")
        jobs.submit(live.settings, live.cluster, "jobs.click_joins", "joins")
        jobs.wait_until_committed(live.settings, live.cluster, "joins")
    finally:
        generator.stop()
    seqs = {f * 1000 + i for f in range(generator.files) for i in range(generator.events_per_file)}
    matches = click_joins.sink("joins", live.settings.database_url)
    wait_for(lambda: {row["seq"] for row in matches.read()} == seqs, 300, "every event joined")
    with session_scope(live.settings.database_url) as s:  # and delivered once: across all batches, every match once
        delivered = s.scalar(select(func.sum(SinkLedger.rows)).where(SinkLedger.job == "joins"))
    assert delivered == len(seqs)
    wait_for(lambda: click_audit.totals(audit_url) == dict(generator.truth), 300, "the audit table exact")
    for job in ("joins", "audit"):
        jobs.cancel(live.settings, live.cluster, job, reason="test finished with it")


@pytest.mark.long  # make test keeps its decisions without Spark, on both registries, in test_move_paths.py's case of
# the same name: the standby killed, warm.prepare going cold and naming it, the job never asked to stop for the warm
# try, then the cold stop, savepoint and successor
def test_a_standby_killed_before_the_hand_over_leaves_the_job_running_and_the_move_goes_cold(live: Cluster,
                                                                                          tmp_path: Path) -> None:
    """A warm move's fallback before the hand-over: its standby on 4.3.0 dies while the job still runs on 4.2.0. The
    job was never asked to stop; the move then goes cold, and the job ends exact."""
    generator = feeding(tmp_path / "landing")
    try:
        first = jobs.submit(live.settings, live.cluster, "jobs.clicks", "fallback",
                            options={"landing": str(generator.landing), "trigger": TRIGGER})
        jobs.wait_until_committed(live.settings, live.cluster, "fallback")
        assert not relocate.step(live.settings, live.cluster, "fallback", "4.3.0", reason="upgrade")
        standby = warm.standby_of(live.settings, live.cluster, first.id)
        assert standby is not None and standby.spark_version == "4.3.0" and standby.submission_id
        wait_for(lambda: jobs.observe(live.settings, live.cluster, standby.id).heartbeat_at is not None, 240,
                 "the standby's driver starting")
        live.cluster.master("4.3.0").kill(standby.submission_id)
        wait_for(lambda: jobs.observe(live.settings, live.cluster, standby.id).ended_at is not None, 120,
                 "the standby ending")
        running = jobs.refresh(live.settings, live.cluster, "fallback")
        assert running is not None and running.id == first.id and running.state == "RUNNING" and not running.parks
        move_to(live, "fallback", "4.3.0")
    finally:
        generator.stop()
    wait_for(lambda: clicks.results(live.settings.database_url, "fallback")[0] == dict(generator.truth), 300,
             "job fallback catching up with every generated file")
    assert [(m.from_run, m.warm) for m in move_history.of(live.settings, "fallback")] == [(first.id, False)]
    cold = [e.details["reason"] for e in audit.find(live.settings.database_url, job="fallback")
            if e.action == "job.move.cold"]
    assert cold and f"its standby run {standby.id} ended KILLED" in cold[-1], cold
    jobs.cancel(live.settings, live.cluster, "fallback", reason="test finished with it")


def test_a_standby_failing_after_the_hand_over_hands_the_job_back_to_its_parked_run_exact(live: Cluster,
                                                                                        tmp_path: Path) -> None:
    """A warm move's fallback after the hand-over: the standby on 4.3.0 gets ready (its warm-up is not the job's
    code), is handed the restored checkpoint, and its first batch fails there. The parked 4.2.0 run takes the job
    back at once, from the batch of the savepoint, and the job ends exact in both its sinks: a keyed table and a
    files sink, each fenced inside its write."""
    job, output = "handback", tmp_path / "out"
    options = {"landing": str(tmp_path / "landing"), "broken_on": "4.3.0", "output": str(output)}
    generator = feeding(tmp_path / "landing")
    try:
        first = jobs.submit(live.settings, live.cluster, str(USER_JOBS / "breaks_on_new_spark.py"), job,
                            options=options)
        jobs.wait_until_committed(live.settings, live.cluster, job)
        wait_for(lambda: relocate.step(live.settings, live.cluster, job, "4.3.0", reason="upgrade"), 300,
                 f"{job} handed to its standby on 4.3.0")
        handed = [e.details for e in audit.find(live.settings.database_url, job=job) if e.action == "job.hand_over"]
        assert len(handed) == 1 and handed[0]["replaces"] == first.id and handed[0]["version"] == "4.3.0", handed
        standby = int(handed[0]["run"])
        wait_for(lambda: jobs.observe(live.settings, live.cluster, standby).ended_at is not None, 240,
                 "the standby failing on its first batch on 4.3.0")
        assert jobs.observe(live.settings, live.cluster, standby).state == "FAILED"
        wait_for(lambda: _current(live, job) == (first.id, "RUNNING"), 120, "the parked run taking the job back")
    finally:
        generator.stop()
    table = KeyedTable(live.settings.database_url, f"{job}_totals", keys=("key",))
    wait_for(lambda: {r["key"]: int(r["count"]) for r in table.read()} == dict(generator.truth), 300,
             f"job {job} counting every generated event on 4.2.0")
    seqs = Counter(f * 1000 + i for f in range(generator.files) for i in range(generator.events_per_file))
    wait_for(lambda: _written_seqs(output) == seqs, 300, f"job {job} writing every event to its files once")
    assert move_history.of(live.settings, job) == []  # the failed standby never took the job over
    unparked = [e.details for e in audit.find(live.settings.database_url, job=job) if e.action == "job.unpark"]
    assert unparked and unparked[-1]["successor"] == standby, unparked
    jobs.cancel(live.settings, live.cluster, job, reason="test finished with it")


def _written_seqs(output: Path) -> Counter[int]:
    """Every event in the files the sink's log lists: what a reader of the output sees, partial files aside."""
    return Counter(seq for file in log_entries(output / LOG) for seq in pq.read_table(file).column("seq").to_pylist())


def _current(live: Cluster, job: str) -> tuple[int, str] | None:
    run = jobs.refresh(live.settings, live.cluster, job)
    return None if run is None else (run.id, run.state)


def test_an_unchanged_script_runs_as_a_batch_job_with_its_own_spark_settings(live: Cluster, tmp_path: Path) -> None:
    jar = tmp_path / "marker.jar"
    with zipfile.ZipFile(jar, "w") as archive:
        archive.writestr("changeover-marker.txt", "shipped")
    spark = SparkSettings(executor_cores=1, executor_memory="640m", shuffle_partitions=7,
                          extra_confs={"spark.changeover.test.marker": "on"}, jars=(str(jar),))
    jobs.submit(live.settings, live.cluster, str(USER_JOBS / "report_settings.py"),
                "settings-report", fault_tolerant=False, options={"spark": asdict(spark)})
    wait_for(lambda: jobs.refresh(live.settings, live.cluster, "settings-report").state == "FINISHED", 240,
             "the script running to its end")
    found = json.loads((live.settings.home / "report_settings.json").read_text())
    assert {k: found[k] for k in ("spark.executor.memory", "spark.sql.shuffle.partitions",
                                  "spark.changeover.test.marker", "counted")} == {
        "spark.executor.memory": "640m", "spark.sql.shuffle.partitions": "7",
        "spark.changeover.test.marker": "on", "counted": 1000}
    assert str(jar) in found["spark.jars"]


@pytest.mark.long  # make test's zero-downtime cases: update_job's through the scheduler (its ledger split at the
# parked batch, its savepoint, exact) and the guide job's follower killed in its cut-over, below; this one adds the
# parquet sink's split and the freshness bounds, and bench/downtime.py (e) measures the same job's move
def test_the_guides_count_moves_with_zero_downtime_its_follower_writing_from_the_parked_batch_on(
        live: Cluster, tmp_path: Path) -> None:
    """Issue 27's move: the standby on 4.3.0 follows the running job read-only from a continue savepoint, writing
    nothing, until it has caught up; then the job parks on a whole batch M and the follower, handed the job, writes
    from M + 1. Every batch lands in the file sink once, the old run's up to M and the follower's after it, the
    cut-over's savepoint of the parked run is there for a rollback, and the output is exact."""
    words, output = Words(tmp_path / "words"), tmp_path / "out" / "counts"
    for _ in range(6):
        words.write()
    first = jobs.submit(live.settings, live.cluster, str(GUIDE_JOB), "zerodowntime",
                        options={"words": str(words.folder), "output": str(output)})
    jobs.wait_until_committed(live.settings, live.cluster, "zerodowntime")
    with words.writing(interval=1.0):
        wait_for(lambda: relocate.step(live.settings, live.cluster, "zerodowntime", "4.3.0", reason="upgrade",
                                       strategy="zero_downtime"), 420, "zerodowntime moving to 4.3.0",
                 interval=0.2, retryable=())
        follower = jobs.refresh(live.settings, live.cluster, "zerodowntime")
        assert follower.spark_version == "4.3.0" and follower.standby_of == first.id
        assert follower.following_since is not None
        jobs.wait_until_committed(live.settings, live.cluster, "zerodowntime")
    events = [e for e in audit.find(live.settings.database_url, job="zerodowntime") if e.action in (
        "job.follow.start", "job.follow.caught_up", "job.request_stop", "job.park", "job.hand_over")]
    assert [e.action for e in events] == ["job.follow.start", "job.follow.caught_up", "job.request_stop",
                                          "job.park", "job.hand_over"], [e.action for e in events]
    parked_at = int(events[3].details["progress"]["windowed_counts"])
    words.flush()
    truth = words.truth()
    wait_for(lambda: parquet_counts(output) == truth, 300, "every closed window in the parquet output")
    writers: dict[int, list[int]] = {}
    for record in (output / "_changeover_batches").iterdir():
        batch, run = record.name.split(".run")
        writers.setdefault(int(run), []).append(int(batch))
    assert set(writers) == {first.id, follower.id}, writers
    assert max(writers[first.id]) == parked_at < min(writers[follower.id]), (parked_at, writers)
    every = sorted(writers[first.id] + writers[follower.id])
    assert len(every) == len(set(every)), "a batch written twice"
    moved = move_history.of(live.settings, "zerodowntime")
    assert [m.kind for m in moved] == ["zero-downtime"], moved
    # Downtime on the checkpoints' own clock: the old run's commit of M to the follower's of M + 1. The follower's
    # first batch read a file that arrived within one writer's interval (1 s) of the old run planning M, so that
    # file waited at least the downtime less that interval; and no file waited longer than the downtime plus a
    # trigger and a batch on each side (the bound fails a count that credits a batch with files it did not read).
    stage = "windowed_counts"
    old_root, new_root = (Path(str(r.checkpoint_root)) / stage for r in (first, follower))
    down = (new_root / "commits" / str(parked_at + 1)).stat().st_mtime - \
        (old_root / "commits" / str(parked_at)).stat().st_mtime
    assert moved[0].freshness is not None and down > 0
    assert down - 1.0 <= moved[0].freshness <= down + 10.0, (down, moved[0])
    print(f"zero-downtime move: {moved[0].describe()}; on the checkpoints' clock {down:.2f} s")
    with session_scope(live.settings.database_url) as s:
        at_cut_over = savepoints.get_savepoint(s, "zerodowntime", f"upgrade-run{first.id}-stop1")
        assert at_cut_over.status == "COMPLETED" and at_cut_over.stages == {"windowed_counts": parked_at}
    jobs.cancel(live.settings, live.cluster, "zerodowntime", reason="test finished with it")


@pytest.mark.long  # make test keeps its decisions without Spark, on both registries, in test_move_paths.py's case of
# the same name (the follower out of time ended, its checkpoint removed, CatchUpTimedOut, the live run never asked to
# stop), and a drain's wait on a follower until its deadline in test_drain_decisions.py's
# test_a_zero_downtime_moves_follower_is_waited_on_until_it_is_level_or_out_of_time
def test_a_follower_too_slow_to_catch_up_is_aborted_and_the_live_run_never_stops(live: Cluster,
                                                                                 tmp_path: Path) -> None:
    """The abort path: the job's code is slow on 4.3.0 (50 ms an event), so its follower there falls further behind
    the live run with every batch. Past the catch-up deadline the move is refused, the follower ended and its
    checkpoint removed; the live run was never asked to stop, and its output is exact. (The deadline stays well
    under the live run's 100 retained batches at 2 a second: past them the follower would end as it cannot follow,
    and the next step would start another.)"""
    job = "tooslow"
    options = {"landing": str(tmp_path / "landing"), "slow_on": "4.3.0"}
    generator = feeding(tmp_path / "landing")
    try:
        first = jobs.submit(live.settings, live.cluster, str(USER_JOBS / "breaks_on_new_spark.py"), job,
                            options=options)
        jobs.wait_until_committed(live.settings, live.cluster, job)
        with pytest.raises(ChangeoverError, match=r"was still .* behind the live run .* the job was never stopped"):
            wait_for(lambda: relocate.step(live.settings, live.cluster, job, "4.3.0", reason="upgrade",
                                           strategy="zero_downtime", catch_up=CatchUp(seconds=20)), 400,
                     f"{job}'s follower", interval=0.5, retryable=())
    finally:
        generator.stop()
    actions = [e.action for e in audit.find(live.settings.database_url, job=job)]
    assert "job.follow.start" in actions and "job.move.zero_downtime.abort" in actions, actions
    assert "job.request_stop" not in actions and "job.park" not in actions, actions
    run = jobs.refresh(live.settings, live.cluster, job)
    assert (run.id, run.state, run.parks) == (first.id, "RUNNING", 0)
    with session_scope(live.settings.database_url) as s:
        followers = list(s.scalars(select(JobRun).where(JobRun.standby_of == first.id)))
    assert len(followers) == 1 and followers[0].state == "STOPPED" and followers[0].following_since is not None
    assert not Path(str(followers[0].checkpoint_root)).exists(), "the follower's checkpoint was not removed"
    table = KeyedTable(live.settings.database_url, f"{job}_totals", keys=("key",))
    wait_for(lambda: {r["key"]: int(r["count"]) for r in table.read()} == dict(generator.truth), 300,
             f"job {job} counting every generated event on 4.2.0")
    jobs.cancel(live.settings, live.cluster, job, reason="test finished with it")


def test_a_follower_killed_in_its_cut_over_leaves_the_job_to_its_parked_run_exact(
        live: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fault in the cut-over: the follower has been handed the job and has caught up to the parked batch, and
    its driver is SIGKILLed before it writes anything. The parked run takes the job back from that batch, never
    both and never neither: every batch is in the file sink once, all of them the old run's, and the output is
    exact."""
    monkeypatch.setenv(faults.SWITCH, "1")  # the drivers launched from here get it too
    words, output = Words(tmp_path / "words"), tmp_path / "out" / "counts"
    for _ in range(6):
        words.write()
    first = jobs.submit(live.settings, live.cluster, str(GUIDE_JOB), "cutover",
                        options={"words": str(words.folder), "output": str(output), "move_strategy": "zero_downtime"})
    jobs.wait_until_committed(live.settings, live.cluster, "cutover")
    faults.arm(live.settings, "follower.caught_up", kill=True)
    with words.writing(interval=1.0):
        wait_for(lambda: relocate.step(live.settings, live.cluster, "cutover", "4.3.0", reason="upgrade"), 420,
                 "cutover handed to its follower on 4.3.0", interval=0.2, retryable=())
        handed = [e.details for e in audit.find(live.settings.database_url, job="cutover")
                  if e.action == "job.hand_over"]
        assert len(handed) == 1 and handed[0]["replaces"] == first.id, handed
        wait_for(lambda: any(line.startswith("follower.caught_up kill") for line in faults.fired(live.settings)),
                 120, "the follower killed once caught up, before its first write")
        # observed as a drain's polls observe it: the follower's end, then the parked run reclaiming the job
        wait_for(lambda: _current(live, "cutover") == (first.id, "RUNNING"), 240, "the parked run taking the job back")
        follower = jobs.observe(live.settings, live.cluster, int(handed[0]["run"]))
        assert follower.ended_at is not None and follower.first_write_at is None, follower
    words.flush()
    truth = words.truth()
    wait_for(lambda: parquet_counts(output) == truth, 300, "every closed window in the parquet output")
    writers = Counter(record.name.split(".run")[1] for record in (output / "_changeover_batches").iterdir())
    batches = [record.name.split(".run")[0] for record in (output / "_changeover_batches").iterdir()]
    assert set(writers) == {str(first.id)} and len(batches) == len(set(batches)), writers
    unparked = [e.details for e in audit.find(live.settings.database_url, job="cutover") if e.action == "job.unpark"]
    assert unparked and unparked[-1]["successor"] == follower.id, unparked
    jobs.cancel(live.settings, live.cluster, "cutover", reason="test finished with it")


def _task_context(task_id: str) -> dict[str, object]:
    """What an operator reads of Airflow's context outside the scheduler: its task instance, no DAG run."""
    ti = SimpleNamespace(dag_id="nightly_reports", run_id="manual__test", task_id=task_id, try_number=1)
    return {"ti": ti, "task_instance": ti, "dag_run": None}


def test_a_batch_application_through_the_routed_spark_submit_operator_holds_a_drain_and_is_killed_with_its_task(
        live: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Spark provider's SparkSubmitOperator arguments, routed by Changeover (run here without the scheduler: its
    execute and on_kill, with the connection read from Airflow's environment variable as a worker reads it). The
    application lands on the largest group (4.2.0: two members against one), a drain of its member waits for it as
    block_shutdown says, it finishes; a second one is killed with its task."""
    from changeover_airflow.spark_submit import RoutedSparkSubmitOperator

    monkeypatch.setenv("AIRFLOW_CONN_CHANGEOVER_DEFAULT", json.dumps({"conn_type": "changeover", "extra": {
        "home": str(live.settings.home), "database_url": live.settings.database_url}}))
    release = tmp_path / "release"

    def operator(name: str) -> RoutedSparkSubmitOperator:
        return RoutedSparkSubmitOperator(task_id=name, application=str(USER_JOBS / "runs_until_released.py"),
                                         name=name, conf={"spark.changeover.test.release": str(release)},
                                         executor_memory="512m", block_shutdown=True, status_poll_interval=1)

    def running(task: RoutedSparkSubmitOperator) -> tuple[threading.Thread, dict[str, object]]:
        ended: dict[str, object] = {}

        def run() -> None:
            try:
                ended["result"] = task.execute(_task_context(task.task_id))
            except ChangeoverError as exc:
                ended["error"] = str(exc)

        thread = threading.Thread(target=run, name=task.task_id)
        thread.start()
        wait_for(lambda: (r := jobs.refresh(live.settings, live.cluster, task.name)) is not None
                 and r.state == "RUNNING" and r.member is not None, 240, f"{task.name} running")
        return thread, ended

    thread, ended = running(operator("nightly-report"))
    run = jobs.refresh(live.settings, live.cluster, "nightly-report")
    assert run is not None and run.spark_version == "4.2.0" and run.member in ("m1", "m2")
    assert drain.plan(live.settings, live.cluster, run.member).wait == ["nightly-report"]  # held, not cancelled
    release.touch()
    thread.join(240)
    assert ended == {"result": {"job": "nightly-report", "run": run.id, "spark_version": "4.2.0",
                                "state": "FINISHED"}}
    assert drain.plan(live.settings, live.cluster, run.member).wait == []

    release.unlink()
    killed = operator("adhoc-report")
    thread, ended = running(killed)
    killed.on_kill()
    thread.join(120)
    assert "its driver ended KILLED" in str(ended.get("error")), ended
    run = jobs.refresh(live.settings, live.cluster, "adhoc-report")
    assert run is not None and run.state == "KILLED"
    assert live.cluster.master("4.2.0").status(run.submission_id).state == "KILLED"
