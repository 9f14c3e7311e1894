from pathlib import Path

import pytest
from changeover import audit
from changeover.registry.db import engine_for, session_scope
from changeover.registry.models import Event
from changeover.registry.schema import migrate
from changeover.settings import Settings
from sqlalchemy import inspect, select, text


def test_migrations_create_every_table_and_are_idempotent(settings: Settings) -> None:
    migrate(settings.database_url)  # a second run changes nothing
    tables = set(inspect(engine_for(settings.database_url)).get_table_names())
    expected = {"members", "masters", "jobs", "job_runs", "savepoints", "upgrade_runs", "events", "sink_ledger"}
    assert expected <= tables


def test_events_record_who_what_when_and_outcome(settings: Settings, monkeypatch) -> None:
    monkeypatch.setenv("CHANGEOVER_ACTOR", "tester")
    with session_scope(settings.database_url) as s:
        audit.record(s, "member.add", "member", "m1", version="4.2.0")
    with session_scope(settings.database_url) as s:
        event = s.scalars(select(Event)).one()
    assert (event.actor, event.action, event.subject, event.outcome) == ("tester", "member.add", "m1", "ok")
    assert event.details == {"version": "4.2.0"} and event.at is not None


def test_only_a_database_that_is_away_is_waited_for(tmp_path) -> None:  # noqa: ANN001
    """A refused connection (a server restarting) is retried until the patience runs out; a missing table is
    refused at once: retrying never clears it."""
    import pytest
    from changeover.cluster.ports import free_port
    from changeover.registry.db import patiently, transient
    from sqlalchemy import text
    from sqlalchemy.exc import OperationalError

    calls: list[int] = []

    def missing_table() -> None:
        calls.append(1)
        with engine_for(f"sqlite:///{tmp_path / 'r.db'}").connect() as conn:
            conn.execute(text("SELECT * FROM no_such_table"))

    with pytest.raises(OperationalError) as missing:
        patiently(missing_table, "test")
    assert not transient(missing.value) and calls == [1]

    away = f"postgresql+psycopg://nobody@127.0.0.1:{free_port()}/none"

    def refused() -> None:
        calls.append(2)
        with engine_for(away).connect():
            pass

    with pytest.raises(OperationalError):
        refused()  # once outside, so the driver's import and the engine's creation are not timed below
    with pytest.raises(OperationalError) as gone:
        patiently(refused, "test", patience=1.2)
    assert transient(gone.value) and calls.count(2) >= 3  # tried again before giving up


def test_a_database_that_answers_no_is_not_waited_for() -> None:
    """A missing database (or role, or a refused password) is a FATAL that retrying never clears."""
    import pytest
    from changeover.registry.db import transient
    from conftest import PG_ADMIN_URL
    from sqlalchemy import make_url
    from sqlalchemy.exc import OperationalError

    if not PG_ADMIN_URL:
        pytest.skip("set CHANGEOVER_TEST_DATABASE_URL to run this against PostgreSQL (CI does)")
    missing = make_url(PG_ADMIN_URL).set(database="changeover_no_such_database").render_as_string(
        hide_password=False)
    with pytest.raises(OperationalError) as refused, engine_for(missing).connect():
        pass
    assert "does not exist" in str(refused.value) and not transient(refused.value)


def test_airflow_refuses_a_registry_behind_this_codes_schema_until_db_upgrade(database_url: str,
                                                                               tmp_path: Path) -> None:
    """Tasks and triggers only read the schema's revision; `changeover db upgrade` is the one step that migrates."""
    import os
    import subprocess
    import sys

    from changeover.errors import ChangeoverError
    from changeover.registry.schema import require_current

    url = database_url  # a new, empty database of each kind
    with pytest.raises(ChangeoverError, match=r"schema is at revision none, and this code needs .*db upgrade"):
        require_current(url)
    env = {**os.environ, **Settings.from_env(home=tmp_path / "home", database_url=url).as_env()}
    done = subprocess.run([sys.executable, "-m", "changeover", "db", "upgrade"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    require_current(url)


def test_a_registry_migrated_by_a_newer_changeover_is_refused_with_what_to_install(settings: Settings) -> None:
    from changeover.errors import ChangeoverError
    from changeover.registry.schema import require_current
    from sqlalchemy import text

    with engine_for(settings.database_url).begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    with pytest.raises(ChangeoverError, match="newer than this code's .*install that Changeover version here too"):
        require_current(settings.database_url)


def test_a_write_waits_for_the_fences_lock_within_a_bound_then_retries(settings: Settings, monkeypatch) -> None:  # noqa: ANN001
    """A holder stuck inside the fence does not hang the writes waiting for it: past LOCK_WAIT_SECONDS the wait
    fails with an error that `patiently` retries (and logs), and once the holder lets go the write gets in."""
    import threading

    import pytest
    from changeover.handoff import fence
    from changeover.registry import db
    from changeover.registry.db import lock_row, patiently, session_scope, transient
    from changeover.registry.models import Job
    from conftest import current_run
    from sqlalchemy.exc import OperationalError

    url = settings.database_url
    if not url.startswith("postgresql"):
        pytest.skip("SQLite bounds every lock wait already: its busy timeout (60 s) is set on each connection")
    run_id = current_run(url, "locked")
    monkeypatch.setattr(db, "LOCK_WAIT_SECONDS", 0.5)
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with session_scope(url) as s:
            lock_row(s, Job, "locked")
            holding.set()
            release.wait(60)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    try:
        assert holding.wait(30)

        def write() -> int:
            with fence.hold(url, "locked", run_id, "events", 0) as held:
                return held.epoch

        with pytest.raises(OperationalError) as timed_out:
            write()
        assert timed_out.value.orig.sqlstate == "55P03" and transient(timed_out.value)
        waits: list[BaseException] = []

        def holder_lets_go(exc: BaseException) -> None:
            waits.append(exc)
            release.set()

        assert patiently(write, "test", patience=30, while_waiting=holder_lets_go) == 1  # the first owner's epoch
        assert len(waits) == 1 and waits[0].orig.sqlstate == "55P03"  # waited for once, then got in
    finally:
        release.set()
        holder.join(30)


def test_a_write_waiting_for_the_registry_gives_up_once_its_driver_stands_down() -> None:
    """A batch waiting inside its write for a registry that does not answer stops waiting when the driver stands
    down, so the driver's stop of its queries is not held up by it."""
    import pytest
    from changeover.runtime.sinks.base import StoodDown, WriteContext
    from sqlalchemy.exc import OperationalError

    context = WriteContext("sqlite://", "cutoff", "events", 7)
    calls: list[int] = []

    def away() -> None:
        calls.append(1)
        if len(calls) == 2:
            context.stand_down.set()
        raise OperationalError("SELECT 1", {}, Exception("connection refused"))

    with pytest.raises(StoodDown, match="write of stage events of job cutoff by run 7"):
        context.patiently(away, "test")
    assert len(calls) == 2  # waited for while the driver stood, given up at its stand-down


def test_only_a_registry_that_does_not_answer_counts_as_away() -> None:
    """A driver stands down for a registry that does not answer, never for a lock wait or a conflict, which a
    registry that answers raises (it would stop a healthy job while another write holds the fence)."""
    from changeover.registry.db import away, transient
    from sqlalchemy.exc import OperationalError

    class Coded(Exception):
        def __init__(self, sqlstate: str) -> None:
            super().__init__(sqlstate)
            self.sqlstate = sqlstate

    def error(orig: Exception) -> OperationalError:
        return OperationalError("SELECT 1", {}, orig)

    assert away(error(Exception("connection failed: Connection refused")))
    assert away(error(Coded("57P01")))  # the server shutting down
    assert away(error(Coded("08006")))  # the connection lost
    for answered in (Coded("55P03"), Coded("40P01"), Coded("40001"), Exception("database is locked")):
        assert transient(error(answered)) and not away(error(answered)), answered
    assert not away(error(Coded("42P01")))  # a missing table: not transient at all


def test_a_run_parked_before_parked_was_a_state_is_parked_after_the_migration(database_url: str) -> None:
    """Before 0013 a parked run was STOPPED with no end; the migration makes it PARKED, and leaves ended runs be."""
    from changeover.registry.models import Job, JobRun, utcnow
    from changeover.registry.states import RunState

    migrate(database_url, "0012")
    with session_scope(database_url) as s:
        s.add(Job(name="old", module="m", fault_tolerant=True, block_shutdown=False, options={}))
        s.flush()
        for ended in (None, utcnow()):  # the columns of 0012: today's model has more
            s.execute(text("INSERT INTO job_runs (job, spark_version, master_url, state, progress, submitted_at, "
                           "ended_at) VALUES ('old', '4.2.0', 'spark://x', 'STOPPED', '{}', :now, :ended)"),
                      {"now": utcnow(), "ended": ended})
    migrate(database_url)
    with session_scope(database_url) as s:
        runs = s.scalars(select(JobRun).order_by(JobRun.id)).all()
        assert [(r.state, r.parked) for r in runs] == [(RunState.PARKED, True), (RunState.STOPPED, False)]
        # a driver launched before 0013 still parks as STOPPED with no end: still parked; a PARKED run that ended is not
        legacy = JobRun(job="old", spark_version="4.2.0", master_url="spark://x", state="STOPPED", progress={})
        ended = JobRun(job="old", spark_version="4.2.0", master_url="spark://x", state="PARKED", progress={},
                       ended_at=utcnow())
        assert legacy.parked and not ended.parked
