"""`changeover sql`'s agent: a background process per home and settings that keeps light jobs' sessions open
between commands.

A `changeover sql` that opened its own session would spend about 3 s importing Spark Connect's client (pandas,
pyarrow, gRPC) and 1 s more on SQLAlchemy and Alembic before it asked the server anything, and as long again the
next time. The first `changeover sql` starts this agent instead (detached, in a session of its own, its log beside
its socket), and every `changeover sql` hands it the statement over a Unix socket that only its user can open, then
prints the rows it answers. The agent runs each statement as any light job runs (routed to the largest version
group, version-checked, registered in the ledger under the CLI's user and actor, heartbeated, interruptible by its
tag), with a pooled session (`changeover.light.session(reuse=True)`): a statement costs its round trip, not a
session's setup. A client that goes away before the answer (Ctrl-C) has its statement interrupted.

The agent exits after IDLE_SECONDS without a statement (CHANGEOVER_SQL_AGENT_IDLE_SECONDS), at
`changeover cluster down`, and when the registry's schema moves under it. Its socket's name holds a digest of the
settings, of the code and of the environment that shapes a session, so a CLI whose settings or code differ starts
an agent of its own, and the other one idles out. `changeover sql --no-agent` (or CHANGEOVER_SQL_AGENT=0) runs the
statement in the CLI's own process. Only this module's client half loads in the CLI: the standard library.
"""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import json
import logging
import os
import select
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from changeover.errors import ChangeoverError

if TYPE_CHECKING:
    from changeover.light import LightSession
    from changeover.settings import Settings

IDLE_SECONDS = 600.0
START_SECONDS = 120.0  # a new agent's imports take about 4 s on an idle 2-core machine, far longer on a busy one
MAX_SOCKET_PATH = 100  # a Unix socket's path holds at most 107 bytes
MAX_REQUEST = 1 << 20
# What shapes a session besides the settings: a CLI run with other values of these gets an agent of its own.
ENV_PREFIXES = ("SPARK_", "PYSPARK_", "GRPC_")
ENV_PROXIES = ("http_proxy", "https_proxy", "no_proxy", "grpc_proxy", "all_proxy")
PACKAGE = Path(__file__).resolve().parents[1]
log = logging.getLogger("changeover.cli.sql_agent")


@dataclass(frozen=True)
class Place:
    key: str
    socket: Path
    lock: Path
    log: Path


def actor() -> str:
    """Who the CLI acts for, as `changeover.audit.current_actor()` says outside an Airflow task (without importing
    the audit module, which loads SQLAlchemy)."""
    return os.environ.get("CHANGEOVER_ACTOR") or f"cli:{getpass.getuser()}"


def enabled() -> bool:
    return os.environ.get("CHANGEOVER_SQL_AGENT", "1") != "0" and hasattr(socket, "AF_UNIX") \
        and hasattr(socket, "SO_PEERCRED")


def key_of(settings: Settings) -> str:
    """A digest of what the agent's sessions depend on: the interpreter, the settings, the environment that shapes a
    session, and this package's code (each file's path, size and time)."""
    digest = hashlib.sha256()
    for part in (sys.executable, str(settings.home), settings.database_url, str(settings.runtimes_dir),
                 str(settings.cluster_file), str(settings.rest_key_file)):
        digest.update(part.encode() + b"\0")
    for name in sorted(os.environ):
        if name.startswith(ENV_PREFIXES) or name.lower() in ENV_PROXIES:
            digest.update(f"{name}={os.environ[name]}".encode() + b"\0")
    for path in sorted(PACKAGE.rglob("*.py")):
        found = path.stat()
        digest.update(f"{path}:{found.st_size}:{found.st_mtime_ns}".encode() + b"\0")
    return digest.hexdigest()[:20]


def _home_tag(settings: Settings) -> str:
    return hashlib.sha256(str(settings.home).encode()).hexdigest()[:8]


def _folders(settings: Settings) -> list[Path]:
    """Where a home's agents keep their sockets: the home's cli/ folder, or a private folder under the system's
    temporary one when the home's path is too long for a socket's."""
    return [settings.home / "cli", Path(tempfile.gettempdir()) / f"changeover-{os.getuid()}"]


def place(settings: Settings, key: str | None = None) -> Place | None:
    """The agent's socket, lock and log for these settings; None if no folder only this user can reach is at hand."""
    key = key or key_of(settings)
    stem = f"sql-agent-{_home_tag(settings)}-{key}"
    for folder in _folders(settings):
        if len(str(folder / f"{stem}.sock")) <= MAX_SOCKET_PATH and _private(folder):
            return Place(key, folder / f"{stem}.sock", folder / f"{stem}.lock", folder / f"{stem}.log")
    return None


def _private(folder: Path) -> bool:
    """The folder exists, is this user's and nobody else's (not a link, no access for group or others)."""
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        found = folder.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(found.st_mode) and found.st_uid == os.getuid() and not found.st_mode & 0o077


def _peer_uid(conn: socket.socket) -> int:
    _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                          struct.calcsize("3i")))
    return int(uid)


def _connect(path: Path, timeout: float) -> socket.socket | None:
    """A connection to the agent at `path` if one listens there and runs as this user."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(timeout)
        conn.connect(str(path))
        if _peer_uid(conn) != os.getuid():
            raise OSError("the socket's owner is another user")
    except OSError:
        conn.close()
        return None
    conn.settimeout(None)
    return conn


def _send(conn: socket.socket, message: dict[str, Any]) -> None:
    conn.sendall(json.dumps(message, default=str).encode() + b"\n")


# -- the CLI's half ------------------------------------------------------------------------------------------------
def run_sql(settings: Settings, statement: str, *, block_shutdown: bool, shutdown_timeout: int, tries: int
            ) -> dict[str, Any] | None:
    """The statement run by the agent, started if none serves these settings: {"rows", "member", "version"}. None
    when no agent took the statement (none could start, or it declined it): the caller then runs it itself. A
    refusal (routing, a version check, Spark's answer) raises ChangeoverError as in the CLI's own process."""
    where = place(settings) if enabled() else None
    if where is None:
        return None
    conn = _connect(where.socket, 2.0) or _start(settings, where)
    if conn is None:
        return None
    with conn, conn.makefile("rb") as answers:
        try:
            _send(conn, {"op": "sql", "key": where.key, "statement": statement, "block_shutdown": block_shutdown,
                         "shutdown_timeout": shutdown_timeout, "tries": tries, "actor": actor(),
                         "user": getpass.getuser()})
            accepted = answers.readline()
        except OSError:
            accepted = b""
        if not accepted or "accepted" not in json.loads(accepted):
            return None  # declined, or gone (stopping as it was asked) before it took the statement: it did not run
        try:
            line = answers.readline()
        except OSError:
            line = b""
    if not line:
        raise ChangeoverError(f"SQL {_short(statement)!r}", "the SQL agent went away before it answered, and the "
                              f"statement may have run (its log: {where.log})",
                              "see how it ended with `changeover light list --all`, then run it again if need be")
    answer = json.loads(line)
    if "error" in answer:
        raise ChangeoverError(**answer["error"])
    return dict(answer)


def _start(settings: Settings, where: Place) -> socket.socket | None:
    """Start an agent for these settings and wait for its socket; None if it failed (its log says why)."""
    env = {**os.environ, **settings.as_env()}
    deadline = time.monotonic() + START_SECONDS
    agent = _spawn(where, env)
    while agent is not None and time.monotonic() < deadline:
        conn = _connect(where.socket, 1.0)
        if conn is not None:
            return conn
        exited = agent.poll()
        if exited == 0:  # another agent holds the lock: it serves soon, or it is stopping and lets go of it
            time.sleep(0.2)
            agent = _spawn(where, env)
        elif exited is not None:
            return None
        else:
            time.sleep(0.05)
    return None


def _spawn(where: Place, env: dict[str, str]) -> subprocess.Popen[bytes] | None:
    descriptor = os.open(where.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        return subprocess.Popen([sys.executable, "-m", "changeover.cli.sql_agent", where.key], env=env,
                                cwd=where.socket.parent, stdin=subprocess.DEVNULL, stdout=descriptor,
                                stderr=subprocess.STDOUT, start_new_session=True)
    except OSError:
        return None
    finally:
        os.close(descriptor)


def stop_all(settings: Settings, wait: float = 15.0) -> int:
    """Ask every agent of this home to stop (`changeover cluster down`), and wait up to `wait` s for them to have
    released their sessions (each lets go of its lock last); returns how many were asked."""
    import fcntl

    asked: list[Path] = []
    for folder in _folders(settings):
        for path in folder.glob(f"sql-agent-{_home_tag(settings)}-*.sock"):
            conn = _connect(path, 2.0)
            if conn is not None:
                with conn, contextlib.suppress(OSError):
                    _send(conn, {"op": "stop"})
                    conn.recv(1024)
                    asked.append(path.with_suffix(".lock"))
    deadline = time.monotonic() + wait
    for lock in asked:
        with contextlib.suppress(OSError):
            descriptor = os.open(lock, os.O_RDWR)
            try:
                while True:
                    try:
                        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break  # the agent is gone
                    except BlockingIOError:
                        if time.monotonic() > deadline:
                            break
                        time.sleep(0.1)
            finally:
                os.close(descriptor)  # and the lock with it
    return len(asked)


def _short(statement: str, chars: int = 60) -> str:
    flat = " ".join(statement.split())
    return flat if len(flat) <= chars else flat[:chars - 3] + "..."


def spark_refusal(statement: str, exc: BaseException) -> ChangeoverError:
    """Spark's answer to a statement it did not run, as a one-line refusal (its first line: the rest is the
    server's stack)."""
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return ChangeoverError(f"SQL {_short(statement)!r}", f"Spark answered {type(exc).__name__}: {first}",
                           "correct the statement, or run it again if it was interrupted (`changeover light list "
                           "--all` says how each light job ended)")


# -- the agent ----------------------------------------------------------------------------------------------------
class _Agent:
    def __init__(self, settings: Settings, where: Place, revision: str | None, idle: float) -> None:
        self.settings, self.where, self.revision, self.idle = settings, where, revision, idle
        self.busy, self.last = 0, time.monotonic()
        self.state = threading.Lock()
        self.server: _Server | None = None

    @contextlib.contextmanager
    def working(self) -> Iterator[None]:
        with self.state:
            self.busy += 1
        try:
            yield
        finally:
            with self.state:
                self.busy -= 1
                self.last = time.monotonic()

    def stop(self) -> None:
        if self.server is not None:
            threading.Thread(target=self.server.shutdown, name="stop", daemon=True).start()

    def watch_idle(self) -> None:
        while True:
            time.sleep(min(1.0, self.idle))
            with self.state:
                idle = self.busy == 0 and time.monotonic() - self.last > self.idle
            if idle:
                log.warning("no statement for %.0f s: stopping", self.idle)
                self.stop()
                return

    def schema_moved(self) -> bool:
        from alembic.runtime.migration import MigrationContext

        from changeover.registry.db import engine_for

        with engine_for(self.settings.database_url).connect() as connection:
            return MigrationContext.configure(connection).get_current_revision() != self.revision

    def handle(self, conn: socket.socket) -> None:
        if _peer_uid(conn) != os.getuid():
            return
        with conn.makefile("rb") as requests:
            line = requests.readline(MAX_REQUEST)
        request = json.loads(line) if line.strip() else {}
        if request.get("op") == "stop":
            _send(conn, {"stopped": True})
            self.stop()
            return
        if request.get("op") != "sql" or request.get("key") != self.where.key:
            _send(conn, {"declined": "not a statement for this agent"})
            return
        with self.working():
            if self.schema_moved():
                _send(conn, {"declined": "the registry's schema moved"})
                log.warning("the registry's schema moved: stopping")
                self.stop()
                return
            _send(conn, {"accepted": True})
            answer = self.run(conn, request)
            with contextlib.suppress(OSError):  # a client gone (Ctrl-C) had its statement interrupted: no one reads
                _send(conn, answer)

    def run(self, conn: socket.socket, request: dict[str, Any]) -> dict[str, Any]:
        from pyspark.errors import PySparkException

        from changeover import audit, light

        statement = str(request["statement"])
        audit.act_as(audit.Acting(str(request["actor"])))  # this thread's: the ledger and the events name the CLI's
        try:
            with light.session(self.settings, statement=statement, block_shutdown=bool(request["block_shutdown"]),
                               shutdown_timeout=int(request["shutdown_timeout"]), tries=int(request["tries"]),
                               user_id=str(request["user"]), reuse=True) as job, _interrupted_when_gone(conn, job):
                rows = [row.asDict(recursive=True) for row in job.spark.sql(statement).collect()]
            return {"rows": rows, "member": job.route.member, "version": job.route.version}
        except ChangeoverError as exc:
            return {"error": {"refused": exc.refused, "reason": exc.reason, "fix": exc.fix}}
        except PySparkException as exc:
            refusal = spark_refusal(statement, exc)
            return {"error": {"refused": refusal.refused, "reason": refusal.reason, "fix": refusal.fix}}
        except Exception as exc:  # noqa: BLE001 - the CLI says it in one line; the log keeps the stack
            log.exception("statement %r failed", _short(statement))
            return {"error": {"refused": f"SQL {_short(statement)!r}", "reason": f"{type(exc).__name__}: {exc}",
                              "fix": f"see the SQL agent's log: {self.where.log}"}}


@contextlib.contextmanager
def _interrupted_when_gone(conn: socket.socket, job: LightSession) -> Iterator[None]:
    """Interrupt the job's operations if its client hangs up before the answer (Ctrl-C, a killed CLI)."""
    wake, woken = socket.socketpair()  # the job's end wakes the watcher at once

    def watch() -> None:
        readable, _, _ = select.select([conn, woken], [], [])
        if woken in readable:
            return
        try:
            gone = not conn.recv(1, socket.MSG_PEEK)
        except OSError:
            gone = True
        if gone:
            log.warning("light job %s: its client went away; interrupting it", job.tag)
            with contextlib.suppress(Exception):
                job.spark.interruptTag(job.tag)

    watcher = threading.Thread(target=watch, name=f"watch-{job.tag}", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        wake.send(b"x")
        watcher.join()
        wake.close()
        woken.close()


if hasattr(socket, "AF_UNIX"):
    import socketserver

    class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
        daemon_threads = False  # closing waits for the statements running
        agent: _Agent

        def finish_request(self, request: Any, client_address: Any) -> None:
            try:
                self.agent.handle(request)
            except Exception:  # noqa: BLE001 - one client's trouble is logged, the agent serves the next
                log.exception("a request failed")


def serve(key: str, idle: float | None = None) -> int:
    """The agent's life: claim the key's lock, check the registry's schema, serve until idle or stopped."""
    import fcntl

    from changeover.settings import Settings

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.umask(0o077)
    settings = Settings.from_env()
    where = place(settings, key)
    if where is None or key_of(settings) != key:
        log.error("the settings or the code this agent was started for changed before it started: exiting")
        return 2
    lock = os.open(where.lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return 0  # another agent serves these settings
    import warnings

    warnings.filterwarnings("ignore", message="PySpark does not yet fully support pandas", category=FutureWarning)
    import pyspark.sql.connect.session  # noqa: F401 - loaded now, not on the first statement

    from changeover import light
    from changeover.registry.schema import require_current

    try:
        require_current(settings.database_url)
    except ChangeoverError as exc:
        log.error("%s", exc)
        return 1
    from alembic.runtime.migration import MigrationContext

    from changeover.registry.db import engine_for

    with engine_for(settings.database_url).connect() as connection:
        revision = MigrationContext.configure(connection).get_current_revision()
    idle = idle if idle is not None else float(os.environ.get("CHANGEOVER_SQL_AGENT_IDLE_SECONDS") or IDLE_SECONDS)
    agent = _Agent(settings, where, revision, idle)
    where.socket.unlink(missing_ok=True)  # a crashed agent's: the lock says none serves it
    server = _Server(str(where.socket), socketserver.BaseRequestHandler)
    server.agent = agent
    agent.server = server
    log.warning("serving %s (pid %d, idle exit after %.0f s)", where.socket, os.getpid(), idle)
    threading.Thread(target=agent.watch_idle, name="idle", daemon=True).start()
    try:
        server.serve_forever(poll_interval=0.5)
    finally:
        where.socket.unlink(missing_ok=True)
        server.server_close()
        light.close_pool()
        log.warning("stopped")
        os.close(lock)  # last: whoever waits for this agent to be gone (`stop_all`) waits for this
    return 0


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1]))
