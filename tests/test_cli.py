"""The CLI refuses bad input with a one-line error and exit code 2, and changes nothing."""

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from changeover.cluster import LocalCluster
from changeover.light import ledger
from changeover.settings import Settings
from fake_fleet import FakeFleet

CLI = [sys.executable, "-m", "changeover"]


def run(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **settings.as_env(), "COLUMNS": "200"}
    return subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["drain", "ghost"], "member 'ghost': no such member"),
        (["upgrade", "member", "ghost", "--to", "4.3.0"], "member 'ghost': no such member"),
        (["upgrade", "member", "ghost", "--to", "7.0.0"], "Spark version '7.0.0'"),
        (["savepoint", "clicks", "../evil", "--cancel"], "savepoint name '../evil'"),
        (["savepoint", "clicks", "a/b", "--cancel"], "savepoint name 'a/b'"),
        (["savepoint", "ghost", "sp1", "--cancel"], "job 'ghost': no such job"),
        (["submit", "jobs.clicks", "--name", "x/y"], "job name 'x/y'"),
        (["submit", "jobs.nope", "--name", "x"], "job code 'jobs.nope': it is neither a file nor an importable"),
        (["submit", "/no/such/job.py", "--name", "x"], "job code '/no/such/job.py': no such Python file"),
        (["submit", "/no/[/such]/[bold]job.py", "--name", "x"],  # brackets are text, never Rich markup
         "job code '/no/[/such]/[bold]job.py': no such Python file"),
        (["submit", "jobs.clicks", "--name", "x", "--executor-memory", "lots"], "executor_memory 'lots'"),
        (["submit", "jobs.clicks", "--name", "x", "--conf", "spark.master=local"], "Spark conf spark.master"),
    ],
)
def test_bad_input_is_refused_in_one_line(settings: Settings, args: list[str], message: str,
                                          monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                          caplog: pytest.LogCaptureFixture) -> None:
    """The console script's own entry point, called in this process: a subprocess per case would spend 2-3 s of
    imports each (the subprocess path is the listings' and the runtime's cases). A warning logged on the way would
    reach the user's terminal too: there is none."""
    from changeover.cli import main

    for key, value in {**settings.as_env(), "COLUMNS": "200"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(sys, "argv", ["changeover", *args])
    with pytest.raises(SystemExit) as exited:
        main()
    stderr = capsys.readouterr().err
    assert exited.value.code == 2, stderr
    assert message in stderr
    assert len(stderr.strip().splitlines()) == 1
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert LocalCluster(settings).status() == {"members": [], "masters": []}


def test_listings_speak_json(settings: Settings) -> None:
    for args in (["savepoints", "--json"], ["jobs", "--json"], ["events", "--json"]):
        result = run(settings, *args)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout) == []


def test_light_jobs_are_listed_and_interrupted_by_tag(settings: Settings) -> None:
    FakeFleet(settings).up([("m1", "4.2.0")], light_jobs=True)
    job = ledger.register(settings, "m1", "4.2.0", "sc://127.0.0.1:1", "s1", "alice", statement="SELECT 1",
                          block_shutdown=True, shutdown_timeout=30)
    listed = json.loads(run(settings, "light", "list", "--json").stdout)
    assert [(r["tag"], r["member"], r["state"], r["user"]) for r in listed] == [(job.tag, "m1", "RUNNING", "alice")]
    done = run(settings, "light", "interrupt", job.tag)  # no server listens there: its row ends all the same
    assert done.returncode == 0 and f"light job {job.tag} interrupted (0 operations)" in done.stdout, done.stderr
    assert ledger.get(settings, job.tag).state == "INTERRUPTED"
    again = run(settings, "light", "interrupt", job.tag)
    assert again.returncode == 2 and "it is INTERRUPTED, not running" in again.stderr
    assert json.loads(run(settings, "light", "list", "--json").stdout) == []


def test_missing_runtime_is_refused(settings: Settings, tmp_path: Path) -> None:
    env = {**os.environ, **settings.as_env(), "CHANGEOVER_RUNTIMES": str(tmp_path / "none")}
    result = subprocess.run([*CLI, "cluster", "up", "--members", "a"], env=env, capture_output=True, text=True)
    assert result.returncode == 2 and "Spark runtime 4.2.0: it is not installed" in result.stderr


def test_busy_port_is_refused_and_nothing_starts(settings: Settings) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = run(settings, "cluster", "up", "--members", "a", "--master-port", str(port))
    assert result.returncode == 2
    assert f"port {port} on 127.0.0.1 for the Spark 4.2.0 master: it is already in use" in result.stderr
    status = json.loads(run(settings, "cluster", "status", "--json").stdout)
    assert status == {"members": [], "masters": []}


def test_the_audit_trail_reads_in_an_80_column_terminal(settings: Settings) -> None:
    from changeover import audit
    from changeover.registry.db import session_scope

    with session_scope(settings.database_url) as s:
        audit.record(s, "job.rescale", "job", "orders", stage="deduplicated_counts", partitions_before=4,
                     partitions=8, batch=22, seconds=2.13, checkpoint="/a/long/path/" + "x" * 90)
    result = subprocess.run([*CLI, "events"], env={**os.environ, **settings.as_env(), "COLUMNS": "80"},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines and max(len(line) for line in lines) <= 80, lines
    assert lines[0].endswith("job.rescale  ok  job:orders") and lines[1].startswith("  by ")
    text = "".join(line.strip() for line in lines[2:])
    assert 'stage="deduplicated_counts"' in text and "partitions=8" in text and "x" * 90 in text


def test_an_upgrade_is_followed_with_a_bar_its_members_phases_and_the_moves_in_80_columns(settings: Settings) -> None:
    from changeover.cli import progress
    from changeover.registry.db import session_scope
    from changeover.registry.models import UpgradeRun
    from sqlalchemy import update

    FakeFleet(settings).up([("m1", "4.3.0"), ("m2", "4.2.0")])
    key = "rolling_upgrade/manual__follow"
    with session_scope(settings.database_url) as s:
        s.add(UpgradeRun(key=key, target_version="4.3.0", members={"m1": "4.2.0", "m2": "4.2.0"}, status="RUNNING",
                         progress={"order": ["m1", "m2"], "phases": {"m1": "UPGRADED", "m2": "DRAINING"}}, active=1))
    printed: list[str] = []
    progress.ChangePrinter(settings, key, printed.append)()
    assert printed == ["  [#-] 1/2 member m1: upgraded, ACTIVE at 4.3.0",
                       "  [#-] 1/2 member m2: draining, ACTIVE at 4.2.0"]
    with session_scope(settings.database_url) as s:
        s.execute(update(UpgradeRun).where(UpgradeRun.key == key).values(status="SUCCEEDED", active=None))
    result = subprocess.run([*CLI, "upgrade", "status", key, "--follow"], timeout=120, capture_output=True,
                            text=True, env={**os.environ, **settings.as_env(), "COLUMNS": "80"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, lines
    assert any("1/2" in line and "SUCCEEDED" in line for line in lines), lines
    assert any(line.split()[:2] == ["m2", "DRAINING"] for line in lines), lines


def _sql_agents(settings: Settings) -> list[psutil.Process]:
    """The SQL agents serving this home: `python -m changeover.cli.sql_agent KEY` with the home in its environment."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if "changeover.cli.sql_agent" in (process.info["cmdline"] or []) \
                    and process.environ().get("CHANGEOVER_HOME") == str(settings.home):
                found.append(process)
    return found


@pytest.fixture
def agents_stopped(settings: Settings) -> Iterator[None]:
    """Whatever the test does, no SQL agent of its home outlives it."""
    try:
        yield
    finally:
        from changeover.cli import sql_agent

        sql_agent.stop_all(settings)
        _gone, left = psutil.wait_procs(_sql_agents(settings), timeout=30)
        for process in left:
            process.kill()
        for folder in sql_agent._folders(settings):  # the shared temporary one keeps no test's lock or log
            for path in folder.glob(f"sql-agent-{sql_agent._home_tag(settings)}-*"):
                path.unlink(missing_ok=True)


def test_sql_goes_through_an_agent_that_cluster_down_stops(settings: Settings, agents_stopped: None) -> None:
    """`changeover sql` hands the statement to an agent it starts; its refusals are the CLI's own, one line, and the
    same with --no-agent; a second statement finds the same agent; `cluster down` stops it."""
    refusal = "light job: no ACTIVE member runs a Spark Connect server"
    first = run(settings, "sql", "SELECT 1")
    assert first.returncode == 2 and refusal in first.stderr and len(first.stderr.strip().splitlines()) == 1, \
        first.stderr
    agents = _sql_agents(settings)
    assert len(agents) == 1
    second = run(settings, "sql", "SELECT 1")
    assert second.returncode == 2 and refusal in second.stderr, second.stderr
    assert _sql_agents(settings) == agents
    here = run(settings, "sql", "--no-agent", "SELECT 1")
    assert here.returncode == 2 and refusal in here.stderr and len(here.stderr.strip().splitlines()) == 1, \
        here.stderr
    assert run(settings, "cluster", "down").returncode == 0
    _gone, left = psutil.wait_procs(agents, timeout=30)
    assert not left
    from changeover.cli import sql_agent

    assert not [p for folder in sql_agent._folders(settings) for p in folder.glob("sql-agent-*.sock")]


def test_an_agent_whose_registry_schema_moved_stops_and_the_cli_says_so(settings: Settings,
                                                                          agents_stopped: None) -> None:
    from changeover.registry.db import session_scope
    from sqlalchemy import text

    assert run(settings, "sql", "SELECT 1").returncode == 2  # no Connect server: the agent is up all the same
    agents = _sql_agents(settings)
    assert len(agents) == 1
    with session_scope(settings.database_url) as s:
        s.execute(text("UPDATE alembic_version SET version_num = '9999_elsewhere'"))
    moved = run(settings, "sql", "SELECT 1")
    assert moved.returncode == 2 and "its schema is at revision 9999_elsewhere" in moved.stderr, moved.stderr
    _gone, left = psutil.wait_procs(agents, timeout=30)
    assert not left


def test_the_sql_agents_place_key_and_words(settings: Settings, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from changeover import audit
    from changeover.cli import sql_agent

    assert sql_agent.actor() == audit.current_actor()
    monkeypatch.setenv("CHANGEOVER_ACTOR", "someone")
    assert sql_agent.actor() == audit.current_actor() == "someone"

    where = sql_agent.place(settings)
    assert where is not None and where.socket.parent in sql_agent._folders(settings)
    assert not where.socket.parent.stat().st_mode & 0o077 and len(str(where.socket)) <= sql_agent.MAX_SOCKET_PATH
    deep = Settings.from_env(home=tmp_path / ("d" * 90) / "home", database_url=settings.database_url)
    far = sql_agent.place(deep)
    assert far is not None and far.socket.parent == sql_agent._folders(deep)[1]  # too long for a socket's path
    open_home = Settings.from_env(home=tmp_path / "open", database_url=settings.database_url)
    (open_home.home / "cli").mkdir(parents=True, mode=0o755)
    (open_home.home / "cli").chmod(0o755)
    shared = sql_agent.place(open_home)  # others may reach the home's cli/ folder: not there
    assert shared is not None and shared.socket.parent == sql_agent._folders(open_home)[1]

    key = sql_agent.key_of(settings)
    assert sql_agent.key_of(settings) == key
    assert sql_agent.key_of(Settings.from_env(home=settings.home, database_url="sqlite:///elsewhere.db")) != key
    monkeypatch.setenv("SPARK_CONNECT_USER_AGENT", "other")
    assert sql_agent.key_of(settings) != key

    class ParseException(Exception):
        pass

    spark_said = ParseException("\n[PARSE_SYNTAX_ERROR] near 'SELEC'\n== SQL ==\nSELEC 1")
    refusal = sql_agent.spark_refusal("SELEC   1", spark_said)
    assert str(refusal).startswith("SQL 'SELEC 1': Spark answered ParseException: [PARSE_SYNTAX_ERROR] near 'SELEC'. ")
    assert "\n" not in str(refusal)
