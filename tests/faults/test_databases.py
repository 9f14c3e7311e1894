"""Databases failing under moves, and Spark retrying work, on one real two-member cluster. The registry's
PostgreSQL, and the users' own PostgreSQL that a keyed table writes into, are servers of the test's own (initdb and
pg_ctl on free ports), so stopping them, or making them ask for a password, touches nothing else on the machine.

- A keyed table in the users' database, apart from the registry: the new version's driver SIGKILLed right after its
  sink committed and before the registry heard of it; and, in a second case, the registry stopped at that point.
- The shipped `ForeachBatch` example through a registry restart mid-batch.
- The registry restarted mid-move: the drivers wait for it (their registry calls and their sinks' writes retry), the
  roll's try that meets it fails and its retry goes on, as an Airflow retry would.
- A parked run that the registry refuses: it gives up, says why, and the move goes on.
- Spark speculation over a staging task held up after it staged its rows.

Each job ends exact against ground truth.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator

import psutil
import pytest
from changeover import audit, faults, jobs, savepoints
from changeover.cli.generator import Generator
from changeover.cluster import LocalCluster, wait_for
from changeover.registry.db import TRANSIENT, forget_engines, session_scope
from changeover.registry.models import JobRun, Member, Savepoint, SinkLedger
from changeover.registry.schema import migrate
from changeover.settings import Settings
from changeover.upgrade import drain, lock, member_upgrade, relocate, roll, verify
from conftest import TRIGGER, drivers_of
from jobs import click_audit, clicks
from pg_server import Server, own_server
from sqlalchemy import func, select

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with own_server() as started:
        yield started


@pytest.fixture(scope="module")
def users_server() -> Iterator[Server]:
    """The users' own database, where their keyed tables live: not the registry's."""
    with own_server() as started:
        yield started


@pytest.fixture(scope="module")
def live(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Settings, LocalCluster]]:
    migrate(server.url)
    settings = Settings.from_env(home=tmp_path_factory.mktemp("databases") / "home", database_url=server.url)
    cluster = LocalCluster(settings)
    try:
        cluster.up([("r1", "4.2.0"), ("r2", "4.2.0")])
        yield settings, cluster
    finally:
        cluster.down()
        forget_engines()
    home = str(settings.home)
    left = [p.info["pid"] for p in psutil.process_iter(["pid", "cmdline"])
            if any(home in part for part in p.info["cmdline"] or [])]
    assert left == [], f"processes left behind: {left}"


@pytest.fixture(autouse=True)
def no_fault_carried_over(live: tuple[Settings, LocalCluster]) -> None:
    """Each case arms its own points and reads only its own firings."""
    shutil.rmtree(live[0].home / "faults", ignore_errors=True)


def _members_at(settings: Settings, cluster: LocalCluster, version: str) -> None:
    """Both members back at `version` for the next case: each is empty, so its drain is done at once."""
    for member in ("r1", "r2"):
        with session_scope(settings.database_url) as s:
            row = s.get(Member, member)
            assert row is not None
            at = (row.version, row.status)
        if at != (version, "ACTIVE"):
            wait_for(lambda m=member: drain.step(settings, cluster, m, 30).done, 120, f"the drain of {member}",
                     interval=1.0, retryable=())
            member_upgrade.upgrade_member(settings, cluster, member, version)


def _begin_roll_to_430(settings: Settings, cluster: LocalCluster, job: str, key: str) -> None:
    """The job's member last, so its move goes to 4.3.0."""
    first = jobs.wait_until_committed(settings, cluster, job)
    other = next(m for m in ("r1", "r2") if m != first.member)
    lock.begin(settings, key, "4.3.0", {other: "4.2.0", first.member: "4.2.0"})
    roll.start(settings, key, [other, first.member], [job])  # as the preflight records the jobs running


def _roll_until_done(settings: Settings, cluster: LocalCluster, key: str) -> None:
    wait_for(lambda: roll.step(settings, cluster, key, 30).done, 900, f"the roll of {key}", interval=2.0,
             retryable=TRANSIENT)


def _exact_in_the_users_database(settings: Settings, cluster: LocalCluster, users: str, job: str,
                                 generator: Generator) -> tuple[list[JobRun], set[int]]:
    """Ends the job once its table matches ground truth; returns its runs and the runs the sink's ledger shows
    writing."""
    generator.stop()
    wait_for(lambda: clicks.results(users, job)[0] == dict(generator.truth), 300,
             f"job {job} catching up with every generated file in the users' database")
    with session_scope(users) as s:  # the sink's own ledger: who wrote, as the sink knows it
        writers = set(s.scalars(select(SinkLedger.run_id).where(SinkLedger.job == job)))
    with session_scope(settings.database_url) as s:
        runs = list(s.scalars(select(JobRun).where(JobRun.job == job).order_by(JobRun.id)))
        saved = s.scalar(select(func.count()).select_from(Savepoint).where(Savepoint.job == job))
    assert runs[0].spark_version == "4.2.0" and {r.spark_version for r in runs[1:]} == {"4.3.0"}
    assert saved == 1  # one stop, one move: the parked run did not take the job back and move it again
    jobs.cancel(settings, cluster, job, reason="test done")
    return runs, writers


@pytest.mark.long  # 120 s, mostly its 60 s lease; CI keeps the decision without Spark on both registries: the
# parked run reads the sink's own ledger and leaves the job to its successor (test_leases_and_fencing)
def test_a_successor_killed_between_its_commit_in_the_users_database_and_the_registry_loses_nothing(
    users_server: Server, live: tuple[Settings, LocalCluster], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its batch is in the users' table and ledger, and nowhere in the registry. The parked run reads the sink's
    ledger, sees that its successor wrote, and leaves the job to it (it does not take the job back and plan that
    batch id again with other offsets). The upgrade's verification names the job as down, with what to do; the
    submit it says continues the job from the successor's checkpoint, which replays that batch with the same
    offsets, and the sink's ledger skips it."""
    settings, cluster = live
    _members_at(settings, cluster, "4.2.0")
    monkeypatch.setenv(faults.SWITCH, "1")  # the drivers launched from here get it too
    generator = Generator(settings.data_dir / "landing-killed")
    generator.write_file()
    generator.start(interval=0.5)
    try:
        jobs.submit(settings, cluster, "jobs.clicks", "killed_after_commit",
                    options={"landing": str(generator.landing), "lease_seconds": 60, "sink_url": users_server.url,
                             "trigger": TRIGGER})
        faults.arm(settings, "keyed_table.committed.4.3.0", kill=True)
        _begin_roll_to_430(settings, cluster, "killed_after_commit", "elsewhere/1")
        _roll_until_done(settings, cluster, "elsewhere/1")
        assert [line.split(" pid ")[0] for line in faults.fired(settings)] == ["keyed_table.committed.4.3.0 kill"]
        down = verify.jobs_left_down(settings, cluster, "elsewhere/1")
        assert len(down) == 1 and down[0].startswith("job killed_after_commit is down: its run ") \
            and "on Spark 4.3.0 ended KILLED" in down[0], down
        lock.release(settings, "elsewhere/1", "FAILED", "its verification named a job down")
        jobs.submit(settings, cluster, "jobs.clicks", "killed_after_commit")  # as the verification's error says
        runs, writers = _exact_in_the_users_database(settings, cluster, users_server.url, "killed_after_commit",
                                                     generator)
    finally:
        generator.stop()
    assert [r.state for r in runs[:2]] == ["STOPPED", "KILLED"] and len(runs) == 3, [
        (r.id, r.state, r.error) for r in runs]
    assert runs[1].first_write_at is None and runs[1].id in writers  # it wrote, and only the sink knows


@pytest.mark.long  # the same gap as the case above, the registry down instead of the successor
def test_the_registry_stopped_between_a_commit_in_the_users_database_and_its_record_loses_nothing(
    server: Server, users_server: Server, live: tuple[Settings, LocalCluster], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The new version's driver is held right after its sink's commit while the registry is stopped; its registry
    transaction is lost with the server. Once the registry is back, its retry finds the batch in the sink's ledger,
    and the parked run, reading that ledger, leaves the job to it."""
    settings, cluster = live
    _members_at(settings, cluster, "4.2.0")
    monkeypatch.setenv(faults.SWITCH, "1")
    point = "keyed_table.committed.4.3.0"
    generator = Generator(settings.data_dir / "landing-unrecorded")
    generator.write_file()
    generator.start(interval=0.5)
    problems: list[BaseException] = []

    def restart_the_registry_once_held() -> None:
        """Beside the roll: a roll step may wait on the job's row, which the held driver's fence locks."""
        try:
            wait_for(lambda: f"{point} hold" in [line.split(" pid ")[0] for line in faults.fired(settings)], 600,
                     "the successor held right after its commit in the users' database", retryable=())
            _restart_registry(settings, server, "job unrecorded stage ", held_at=point)
        except BaseException as exc:  # noqa: BLE001 - reported by the test's thread
            problems.append(exc)

    watcher = threading.Thread(target=restart_the_registry_once_held, daemon=True)
    try:
        jobs.submit(settings, cluster, "jobs.clicks", "unrecorded",
                    options={"landing": str(generator.landing), "lease_seconds": 60, "sink_url": users_server.url,
                             "trigger": TRIGGER})
        faults.arm(settings, point, hold=True)
        _begin_roll_to_430(settings, cluster, "unrecorded", "elsewhere/2")
        watcher.start()
        _roll_until_done(settings, cluster, "elsewhere/2")
        watcher.join(300)
        assert not watcher.is_alive() and not problems, problems
        assert verify.jobs_left_down(settings, cluster, "elsewhere/2") == []
        lock.release(settings, "elsewhere/2", "SUCCEEDED", "test")
        runs, writers = _exact_in_the_users_database(settings, cluster, users_server.url, "unrecorded", generator)
    finally:
        faults.release(settings, point)
        generator.stop()
    assert len(runs) == 2 and runs[1].id in writers  # the successor went on: no continuation needed
    assert runs[1].first_write_at is not None  # recorded by its retry, once the registry was back


def _drivers_met_the_outage(settings: Settings, needle: str) -> bool:
    """A driver's call that names `needle` has logged its wait for the registry (its Python's output lands in the
    driver folder's stdout and stderr)."""
    logs = [*settings.cluster_dir.rglob("stdout"), *settings.cluster_dir.rglob("stderr")]
    return any("the database did not answer" in line and needle in line
               for log in logs if log.is_file() for line in log.read_text(errors="replace").splitlines())


def _restart_registry(settings: Settings, server: Server, needle: str, held_at: str | None = None) -> None:
    """Stop the registry, let a driver held at fault point `held_at` go on into the outage, wait until a driver's
    call that names `needle` has met it, and start the registry again."""
    before = server.pid()
    server.stop()
    try:
        if held_at is not None:
            faults.release(settings, held_at)
        wait_for(lambda: _drivers_met_the_outage(settings, needle), 120, f"{needle!r} waiting for the registry")
    finally:
        server.start()
    assert server.pid() != before


def test_the_shipped_foreach_batch_example_goes_on_through_a_registry_restart_mid_batch(
    server: Server, users_server: Server, live: tuple[Settings, LocalCluster], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The example's function has written a batch, its epoch row included, into the users' database; the registry
    stops before it records the delivery, and the fence's transaction is lost with it. Once the registry is back the
    batch is delivered again under the same epoch, which the example's own check accepts: the job goes on under the
    same run, and its table is exact."""
    settings, cluster = live
    monkeypatch.setenv(faults.SWITCH, "1")
    generator = Generator(settings.data_dir / "landing-audited")
    generator.write_file()
    generator.start(interval=0.5)
    point = "foreach.delivered"
    try:
        first = jobs.submit(settings, cluster, "jobs.click_audit", "audited",
                            options={"landing": str(generator.landing), "audit_url": users_server.url,
                                     "trigger": TRIGGER})
        jobs.wait_until_committed(settings, cluster, "audited")
        faults.arm(settings, point, hold=True)
        wait_for(lambda: any(line.startswith(f"{point} hold") for line in faults.fired(settings)), 120,
                 "a batch delivered and held before the registry records it")
        # the delivery's own retry: the batch goes to the function again once the registry is back
        _restart_registry(settings, server, "job audited stage audit batch ", held_at=point)
    finally:
        faults.release(settings, point)
        generator.stop()
    wait_for(lambda: click_audit.totals(users_server.url) == dict(generator.truth), 300,
             "the example's table exact in the users' database")
    run = jobs.refresh(settings, cluster, "audited")
    assert run is not None and run.id == first.id and run.state == "RUNNING"  # never failed, never refused itself
    jobs.cancel(settings, cluster, "audited", reason="test done")


def test_the_registry_restarted_mid_move_loses_nothing_and_the_roll_goes_on(
    server: Server, live: tuple[Settings, LocalCluster]
) -> None:
    settings, cluster = live
    _members_at(settings, cluster, "4.2.0")
    generator = Generator(settings.data_dir / "landing")
    generator.write_file()
    generator.start(interval=0.5)
    try:
        jobs.submit(settings, cluster, "jobs.clicks", "restarted",
                    options={"landing": str(generator.landing), "lease_seconds": 60, "trigger": TRIGGER})
        first = jobs.wait_until_committed(settings, cluster, "restarted")
        other = next(m for m in ("r1", "r2") if m != first.member)
        lock.begin(settings, "restart/1", "4.3.0", {other: "4.2.0", first.member: "4.2.0"})
        roll.start(settings, "restart/1", [other, first.member])

        def handing_over() -> bool:  # the job parked on its member, its successor launched on 4.3.0
            status = roll.step(settings, cluster, "restart/1", 30)
            return status.current == first.member and status.drain is not None and bool(status.drain.handoff)

        wait_for(handing_over, 600, "the job's successor launched", interval=1.0, retryable=())
        # during the hand-over: the parked run, its successor's start and its first write all need the registry
        _restart_registry(settings, server, "job restarted ")
        # A roll try that meets the restart fails; its retry goes on from the registry's record, as Airflow's would.
        wait_for(lambda: roll.step(settings, cluster, "restart/1", 30).done, 900, "the roll after the restart",
                 interval=2.0, retryable=TRANSIENT)
        lock.release(settings, "restart/1", "SUCCEEDED", "test")
    finally:
        generator.stop()
    wait_for(lambda: clicks.results(settings.database_url, "restarted")[0] == dict(generator.truth), 300,
             "job restarted catching up with every generated file")
    run = jobs.refresh(settings, cluster, "restarted")
    assert run is not None and run.state in jobs.LIVE and run.spark_version == "4.3.0"
    with session_scope(settings.database_url) as s:
        runs = list(s.scalars(select(JobRun).where(JobRun.job == "restarted").order_by(JobRun.id)))
        members = {(m.name, m.version, m.status) for m in s.scalars(select(Member))}
    assert [r.spark_version for r in runs] == ["4.2.0", "4.3.0"]  # one move, no run lost to the restart
    assert members == {("r1", "4.3.0", "ACTIVE"), ("r2", "4.3.0", "ACTIVE")}
    jobs.cancel(settings, cluster, "restarted", reason="test done")


def test_a_parked_run_that_the_registry_refuses_gives_up_says_why_and_the_move_goes_on(
    server: Server, live: tuple[Settings, LocalCluster]
) -> None:
    """While the job's run is parked for a move (its lease 600 s), the registry starts to ask for a password the
    drivers do not have, as after a rotated secret. No wait clears that: the parked run gives up at once and its
    driver ends, freeing its cores, with its reason left beside its checkpoint. Once the registry lets the control
    plane in again, the run's `job.end` carries that reason, and the move goes on from the parked run's checkpoint."""
    settings, cluster = live
    generator = Generator(settings.data_dir / "landing-refused")
    generator.write_file()
    generator.start(interval=0.5)
    try:
        first = jobs.submit(settings, cluster, "jobs.clicks", "refused",
                            options={"landing": str(generator.landing), "lease_seconds": 600, "trigger": TRIGGER})
        jobs.wait_until_committed(settings, cluster, "refused")
        savepoints.request_stop(settings, "refused", "a move the test begins", move=True)

        def parked() -> bool:
            with session_scope(settings.database_url) as s:
                run = s.get(JobRun, first.id)
                return run is not None and run.parked

        wait_for(parked, 120, "the job's run parked")
        assert drivers_of("refused", first.id)
        server.require_a_password()
        try:  # well within the lease: the driver does not wait for what waiting cannot clear
            wait_for(lambda: not drivers_of("refused", first.id), 120, "the parked run's driver ending",
                     retryable=(psutil.Error,))
        finally:
            server.trust_again()
            forget_engines()  # the test's own pooled connections were ended with the others
        wait_for(lambda: jobs.refresh(settings, cluster, "refused").ended_at is not None, 120,  # type: ignore[union-attr]
                 "its master reporting the parked run's driver ended")
        ended = jobs.refresh(settings, cluster, "refused")
        assert ended is not None and ended.id == first.id
        assert (ended.error or "").startswith("parked, it gave up its lease and ended after ") \
            and "the registry refused it (" in ended.error and "password" in ended.error, ended.error
        [end] = [e for e in audit.find(settings.database_url, job="refused") if e.action == "job.end"]
        assert end.details["reason"] == ended.error
        assert ended.state == "STOPPED" and "job.fail" not in {e.action for e in audit.find(settings.database_url,
                                                                                            job="refused")}
        wait_for(lambda: relocate.step(settings, cluster, "refused", first.spark_version, reason="test",
                                       avoid_member=first.member), 300,
                 "the move from the parked run's checkpoint", interval=2.0, retryable=())
    finally:
        generator.stop()
    wait_for(lambda: clicks.results(settings.database_url, "refused")[0] == dict(generator.truth), 300,
             "job refused catching up with every generated file")
    with session_scope(settings.database_url) as s:
        runs = list(s.scalars(select(JobRun).where(JobRun.job == "refused").order_by(JobRun.id)))
    assert [r.id for r in runs][0] == first.id and len(runs) == 2 and runs[1].state in jobs.LIVE
    jobs.cancel(settings, cluster, "refused", reason="test done")


def _speculated_over(settings: Settings, tid: str) -> bool:
    """Spark's driver log says it killed task attempt `tid` because a speculative attempt of it succeeded."""
    logs = [log for log in settings.cluster_dir.rglob("stderr") if log.is_file()]
    return any(f"(TID {tid}) on" in line and "as the attempt 1 succeeded on" in line
               for log in logs for line in log.read_text(errors="replace").splitlines())


def test_a_speculated_staging_task_lands_each_batch_once(
    users_server: Server, live: tuple[Settings, LocalCluster], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `spark.speculation` on and the job's executors on both members (two hosts), one staging task is held up
    right after it staged its rows (an injected 30 s delay). Spark runs a second attempt on the other host, which
    stages the same rows and finishes first; the merge takes only the attempt Spark accepted, so the batch lands
    once. Merging every attempt's rows would refuse that batch as "keys occur more than once" and fail the job."""
    settings, cluster = live
    monkeypatch.setenv(faults.SWITCH, "1")
    spark = {"cores_max": 2, "extra_confs": {
        "spark.speculation": "true", "spark.speculation.interval": "200ms", "spark.speculation.quantile": "0.5",
        "spark.speculation.minTaskRuntime": "2s",
        # the fault point is reached on an executor: its environment names the switch and the home
        "spark.executorEnv.CHANGEOVER_FAULTS": "1", "spark.executorEnv.CHANGEOVER_HOME": str(settings.home)}}
    generator = Generator(settings.data_dir / "landing-speculated")
    generator.write_file()
    generator.start(interval=0.5)
    try:
        first = jobs.submit(settings, cluster, "jobs.clicks", "speculated",
                            options={"landing": str(generator.landing), "sink_url": users_server.url, "spark": spark,
                                     "trigger": TRIGGER})
        jobs.wait_until_committed(settings, cluster, "speculated")
        faults.arm(settings, "keyed_table.staged", delay=30)
        wait_for(lambda: faults.fired(settings), 120, "a staging task held up after it staged its rows")
        [held] = faults.fired(settings)
        assert held.startswith("keyed_table.staged delay 30 pid ")
        tid = held.split(" TID ")[1]
        wait_for(lambda: _speculated_over(settings, tid), 180, f"Spark accepting a speculative attempt over TID {tid}")
    finally:
        generator.stop()
    wait_for(lambda: clicks.results(users_server.url, "speculated")[0] == dict(generator.truth), 300,
             "job speculated catching up with every generated file in the users' database")
    run = jobs.refresh(settings, cluster, "speculated")
    assert run is not None and run.id == first.id and run.state == "RUNNING"  # no batch refused, no restart
    jobs.cancel(settings, cluster, "speculated", reason="test done")
