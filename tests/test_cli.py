"""The CLI refuses bad input with a one-line error and exit code 2, and changes nothing."""

import contextlib
import json
import logging
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from changeover.cluster import LocalCluster
from changeover.light import ledger
from changeover.settings import Settings
from fake_fleet import FakeFleet

CLI = [sys.executable, "-m", "changeover"]
AGENT = {"CHANGEOVER_SQL_AGENT": "1"}  # the SQL agent without a terminal, as a script asks for it


def run(settings: Settings, *args: str, extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI in a process of its own, its standard input not a terminal, as a script runs it."""
    env = {**os.environ, **settings.as_env(), "COLUMNS": "200", **(extra or {})}
    return subprocess.run([*CLI, *args], env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=120)


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
    """The SQL agents serving this home: `python -m changeover.cli.sql_agent_server KEY`, the home in its env."""
    found = []
    for process in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if "changeover.cli.sql_agent_server" in (process.info["cmdline"] or []) \
                    and process.environ().get("CHANGEOVER_HOME") == str(settings.home):
                found.append(process)
    return found


@pytest.fixture
def agents_stopped(settings: Settings) -> Iterator[None]:
    """Whatever the test does, no SQL agent of its home outlives it: asked to stop, else killed, even when the asking
    fails."""
    from changeover.cli import sql_agent

    try:
        yield
    finally:
        try:
            sql_agent.stop_all(settings)
        finally:
            _gone, left = psutil.wait_procs(_sql_agents(settings), timeout=30)
            for process in left:
                with contextlib.suppress(psutil.Error):
                    process.kill()
            for folder in sql_agent._folders(settings):  # the shared temporary one keeps no test's lock or log
                for path in folder.glob(f"sql-agent-{sql_agent._home_tag(settings)}-*"):
                    path.unlink(missing_ok=True)


def test_sql_goes_through_an_agent_that_cluster_down_stops(settings: Settings, agents_stopped: None) -> None:
    """`changeover sql` hands the statement to an agent it starts; its refusals are the CLI's own, one line, and the
    same with --no-agent; a second statement finds the same agent; `cluster down` stops it. The registry's URL is
    in neither the agent's command line nor its environment (it reads the reference file every child reads)."""
    refusal = "light job: no ACTIVE member runs a Spark Connect server"
    first = run(settings, "sql", "SELECT 1", extra={**AGENT, "CHANGEOVER_DATABASE_URL": settings.database_url})
    assert first.returncode == 2 and refusal in first.stderr and len(first.stderr.strip().splitlines()) == 1, \
        first.stderr
    agents = _sql_agents(settings)
    assert len(agents) == 1
    assert "CHANGEOVER_DATABASE_URL" not in agents[0].environ()
    assert not [arg for arg in agents[0].cmdline() if settings.database_url in arg]
    second = run(settings, "sql", "SELECT 1", extra=AGENT)
    assert second.returncode == 2 and refusal in second.stderr, second.stderr
    assert _sql_agents(settings) == agents
    here = run(settings, "sql", "--no-agent", "SELECT 1")
    assert here.returncode == 2 and refusal in here.stderr and len(here.stderr.strip().splitlines()) == 1, \
        here.stderr
    assert run(settings, "cluster", "down").returncode == 0
    _gone, left = psutil.wait_procs(agents, timeout=30)
    assert not left
    from changeover.cli import sql_agent

    mine = f"sql-agent-{sql_agent._home_tag(settings)}-*.sock"  # the shared folder may hold other tests' agents
    assert not [p for folder in sql_agent._folders(settings) for p in folder.glob(mine)]


def test_an_agent_whose_registry_schema_moved_stops_and_the_cli_says_so(settings: Settings,
                                                                          agents_stopped: None) -> None:
    from changeover.registry.db import session_scope
    from sqlalchemy import text

    no_server = run(settings, "sql", "SELECT 1", extra=AGENT)
    assert no_server.returncode == 2, no_server.stderr  # no Connect server: the agent is up all the same
    agents = _sql_agents(settings)
    assert len(agents) == 1
    with session_scope(settings.database_url) as s:
        s.execute(text("UPDATE alembic_version SET version_num = '9999_elsewhere'"))
    moved = run(settings, "sql", "SELECT 1", extra=AGENT)
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


def test_the_agent_is_for_a_terminal_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """From a terminal `changeover sql` goes through the agent; a script's or CI's (stdin not a TTY) does not unless
    CHANGEOVER_SQL_AGENT=1 or an explicit --agent (force) asks; CHANGEOVER_SQL_AGENT=0 turns it off."""
    from changeover.cli import sql_agent

    for terminal in (True, False):
        monkeypatch.setattr(sql_agent, "_interactive", lambda terminal=terminal: terminal)
        monkeypatch.delenv("CHANGEOVER_SQL_AGENT", raising=False)
        assert sql_agent.enabled() is terminal and sql_agent.enabled(force=True)
        monkeypatch.setenv("CHANGEOVER_SQL_AGENT", "1")
        assert sql_agent.enabled()
        monkeypatch.setenv("CHANGEOVER_SQL_AGENT", "0")
        assert not sql_agent.enabled() and sql_agent.enabled(force=True)


def test_the_agents_key_command_line_and_environment_hold_no_password(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from changeover.cli import sql_agent
    from sqlalchemy.engine import make_url

    for url in ("postgresql+psycopg://root:s3cret@127.0.0.1:5432/test", "postgresql://u:p%40ss@db.example:5432/x",
                "postgresql://u:s3cret@h/db?sslmode=require", "postgresql+psycopg://root@127.0.0.1:5432/test",
                f"sqlite:///{tmp_path / 'registry.db'}"):
        assert sql_agent.hide_password(url) == make_url(url).render_as_string(hide_password=True)
    assert sql_agent.hide_password("postgresql://u@h/db?password=s3cret&sslmode=require") == \
        "postgresql://u@h/db?password=***&sslmode=require"

    home = tmp_path / "home"
    secret = Settings.from_env(home=home, database_url="postgresql://u:s3cret@h/db")
    key = sql_agent.key_of(secret)
    assert sql_agent.key_of(Settings.from_env(home=home, database_url="postgresql://u:other@h/db")) == key
    assert sql_agent.key_of(Settings.from_env(home=home, database_url="postgresql://u:s3cret@h2/db")) != key
    for name in ("TZ", "CHANGEOVER_FAULTS", "CHANGEOVER_CRASH_AT"):  # they shape what a statement does
        monkeypatch.setenv(name, "x")
        assert sql_agent.key_of(secret) != key
        monkeypatch.delenv(name)
    assert sql_agent.key_of(secret) == key

    monkeypatch.setenv("CHANGEOVER_DATABASE_URL", secret.database_url)
    spawned: dict[str, object] = {}
    monkeypatch.setattr(sql_agent.subprocess, "Popen", lambda args, **options: spawned.update(args=args, **options))
    where = sql_agent.place(secret)
    assert where is not None
    try:
        sql_agent._spawn(where, sql_agent.agent_env(secret))
    finally:
        where.log.unlink(missing_ok=True)
    args, env = spawned["args"], spawned["env"]
    assert isinstance(args, list) and isinstance(env, dict)
    assert args[-1] == key and not [a for a in args if "s3cret" in a]
    assert not [name for name, value in env.items() if "s3cret" in value]
    assert Path(env["CHANGEOVER_DATABASE_URL_FILE"]).read_text() == secret.database_url  # how the agent reads it


def test_peer_credentials_are_read_with_unsigned_ids() -> None:
    """struct ucred is pid_t (signed), uid_t and gid_t (unsigned): a uid above 2**31 reads as itself."""
    from changeover.cli import sql_agent

    class Peer:
        def getsockopt(self, level: int, option: int, size: int) -> bytes:
            assert (level, option, size) == (socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            return struct.pack("iII", 4242, 2**32 - 2, 2**31 + 7)

    assert sql_agent.peer_uid(Peer()) == 2**32 - 2  # type: ignore[arg-type]
    one, other = socket.socketpair()
    with one, other:
        assert sql_agent.peer_uid(one) == os.getuid()


def test_the_agents_log_and_lock_are_opened_only_as_this_users_own_files(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from changeover.cli import sql_agent
    from changeover.errors import ChangeoverError

    victim = tmp_path / "victim"
    victim.write_text("keep")
    link = tmp_path / "agent.log"
    link.symlink_to(victim)
    with pytest.raises(ChangeoverError) as refused:
        sql_agent.open_private(link, "log")
    said = str(refused.value)
    assert said.startswith(f"the SQL agent's log {link}: it is a symbolic link") and f"rm {link}" in said, said
    assert "\n" not in said and victim.read_text() == "keep"
    fifo = tmp_path / "agent.lock"
    os.mkfifo(fifo)
    with pytest.raises(ChangeoverError, match="it is not a regular file"):
        sql_agent.open_private(fifo, "lock")  # refused at once, not waited on

    own = tmp_path / "own.log"
    descriptor = sql_agent.open_private(own, "log")
    os.write(descriptor, b"line\n")
    os.close(descriptor)
    assert own.read_text() == "line\n" and own.stat().st_mode & 0o777 == 0o600
    real = os.getuid()
    with monkeypatch.context() as patched:
        patched.setattr(os, "getuid", lambda: real + 1)
        with pytest.raises(ChangeoverError, match=f"it belongs to user id {real}, not to you"):
            sql_agent.open_private(own, "log")

    settings = Settings.from_env(home=tmp_path / "home", database_url=f"sqlite:///{tmp_path / 'registry.db'}")
    where = sql_agent.place(settings)
    assert where is not None
    where.log.symlink_to(victim)
    try:  # the CLI says so, and starts nothing
        with pytest.raises(ChangeoverError, match="symbolic link"):
            sql_agent._spawn(where, sql_agent.agent_env(settings))
    finally:
        where.log.unlink()
    assert victim.read_text() == "keep"


def test_a_lock_held_without_a_socket_has_the_cli_run_the_statement_itself(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch,
                                                                            capsys: pytest.CaptureFixture[str]
                                                                            ) -> None:
    """Another agent holds the lock (stuck, stopping, or slow to start) and opens no socket: each agent spawned exits
    0 at once, and after HELD_SECONDS the CLI stops waiting, says so, and runs the statement itself."""
    from changeover.cli import sql_agent

    settings = Settings.from_env(home=tmp_path / "home", database_url=f"sqlite:///{tmp_path / 'registry.db'}")
    spawned: list[float] = []

    class LockHeld:
        def poll(self) -> int:
            return 0

    monkeypatch.setattr(sql_agent, "_spawn", lambda where, env: spawned.append(time.monotonic()) or LockHeld())
    monkeypatch.setattr(sql_agent, "HELD_SECONDS", 1.0)
    began = time.monotonic()
    assert sql_agent.run_sql(settings, "SELECT 1", block_shutdown=True, shutdown_timeout=30, tries=3,
                             force=True) is None
    assert time.monotonic() - began < 10 and 2 <= len(spawned) <= 6, spawned
    said = capsys.readouterr().err
    assert "another SQL agent holds" in said and "running the statement in this process" in said, said


def test_a_silent_client_does_not_hold_the_agent() -> None:
    """A client that connects and sends nothing frees its handler; handlers are daemons and the server's close
    waits for none of them (`serve` waits STOP_SECONDS at most for statements running)."""
    from changeover.cli import sql_agent, sql_agent_server

    place = sql_agent.Place("k", Path("/nonexistent.sock"), Path("/nonexistent.lock"), Path("/nonexistent.log"))
    agent = sql_agent_server._Agent(Settings.from_env(home="/nonexistent", database_url="sqlite://"), place, None, 60)
    silent, served = socket.socketpair()
    with silent, served, pytest.MonkeyPatch.context() as patched:
        patched.setattr(sql_agent_server, "REQUEST_SECONDS", 0.2)
        began = time.monotonic()
        agent.handle(served)
        assert time.monotonic() - began < 5
    assert sql_agent_server._Server.daemon_threads and not sql_agent_server._Server.block_on_close


class _Spark:
    """A Connect session's stand-in: what the agent's statement and its client watcher call."""

    def __init__(self, run: object) -> None:
        self.run, self.interrupts = run, []
        self.client: socket.socket | None = None  # the CLI's end of the connection, to hang up

    def sql(self, statement: str) -> object:
        return self.run(statement)

    def interruptTag(self, tag: str) -> list[str]:  # noqa: N802 - pyspark's name
        self.interrupts.append((time.monotonic(), tag))
        return []  # nothing running yet: the race an interrupt must keep trying through


def _serve_one(settings: Settings, monkeypatch: pytest.MonkeyPatch, spark: _Spark, hang_up: str
               ) -> tuple[dict[str, object], socket.socket]:
    """One `changeover sql` handled by an agent in this process with light.session faked (a ledger row registered
    on a fake member, and ended as light.session ends it); the client hangs up when `hang_up` says: 'registered' (as
    the job is routed and registered) or 'started' (once the statement runs). Returns what the fake saw."""
    from changeover import light
    from changeover.cli import sql_agent
    from changeover.cli.sql_agent_server import _Agent, _revision

    FakeFleet(settings).up([("m1", "4.2.0")], light_jobs=True)
    client, served = socket.socketpair()
    spark.client = client
    seen: dict[str, object] = {}

    @contextlib.contextmanager
    def session(settings_: Settings, *, statement: str, user_id: str, reuse: bool, **options: object
                ) -> Iterator[object]:
        job = ledger.register(settings_, "m1", "4.2.0", "sc://127.0.0.1:1", "s1", user_id, statement=statement,
                              block_shutdown=True, shutdown_timeout=30)
        seen.update(reuse=reuse, tag=job.tag)
        if hang_up == "registered":
            client.close()
        outcome, error = "SUCCEEDED", None
        try:
            yield light.LightSession(spark, light.Route("m1", "4.2.0", "sc://127.0.0.1:1"), job.tag, [])
        except BaseException as exc:
            outcome = "INTERRUPTED" if "OPERATION_CANCELED" in str(exc) else "FAILED"
            error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            ledger.finish(settings_, job.tag, outcome, error)

    monkeypatch.setattr(light, "session", session)
    where = sql_agent.place(settings)
    assert where is not None
    agent = _Agent(settings, where, _revision(settings.database_url), 60)
    client.sendall(json.dumps({"op": "sql", "key": where.key, "statement": "DROP TABLE t", "block_shutdown": True,
                               "shutdown_timeout": 30, "tries": 3, "actor": "cli:test", "user": "alice"}).encode()
                   + b"\n")
    handler = threading.Thread(target=agent.handle, args=(served,))  # its own context: act_as stays there
    handler.start()
    handler.join(timeout=60)
    assert not handler.is_alive()
    served.close()
    return seen, client


def test_a_statement_whose_client_hung_up_before_it_started_is_not_run(settings: Settings,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while the statement is routed, version-checked and registered: it is not started, and its light job
    ends INTERRUPTED with the reason. Each statement asks for a session of its own (reuse=False)."""
    ran: list[str] = []
    seen, client = _serve_one(settings, monkeypatch, _Spark(ran.append), hang_up="registered")
    client.close()
    assert ran == [] and seen["reuse"] is False
    row = ledger.get(settings, str(seen["tag"]))
    assert row.state == "INTERRUPTED" and "went away" in (row.error or "") and "not run" in (row.error or "")


def test_a_started_statement_whose_client_hung_up_is_interrupted_until_it_ends(settings: Settings,
                                                                              monkeypatch: pytest.MonkeyPatch
                                                                              ) -> None:
    """The client hangs up once the statement runs; the first interrupts find nothing (its operation not on the
    server yet), and the agent keeps interrupting until the statement's block ends, then stops."""
    def statement(text: str) -> object:
        spark.client.close()  # Ctrl-C, just as the statement started
        deadline = time.monotonic() + 30
        while len(spark.interrupts) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        raise RuntimeError("[OPERATION_CANCELED] the operation was interrupted")

    spark = _Spark(statement)
    seen, _client = _serve_one(settings, monkeypatch, spark, hang_up="started")
    assert len(spark.interrupts) >= 3 and {tag for _, tag in spark.interrupts} == {seen["tag"]}
    count = len(spark.interrupts)
    time.sleep(0.6)
    assert len(spark.interrupts) == count  # none once its block ended
    assert ledger.get(settings, str(seen["tag"])).state == "INTERRUPTED"
