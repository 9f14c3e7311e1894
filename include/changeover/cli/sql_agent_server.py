"""The SQL agent's half of `changeover.cli.sql_agent` (which see): serve `changeover sql` statements over the Unix
socket, each as a light job in a Spark session of its own, until idle, stopped, or the registry's schema moves.

A statement's client may hang up at any point (Ctrl-C, a killed CLI): `ClientWatch` notices, and the statement is
not started if it has not been (its light job, registered by then, ends INTERRUPTED with the reason), or its
operations are interrupted by tag, again and again, until its block ends (an interrupt sent before the first
operation reaches the server finds nothing to interrupt). Every socket a handler uses has a timeout and every
handler thread is a daemon, so no client keeps the agent, and the lock that makes other agents wait, alive.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from changeover.cli import sql_agent
from changeover.errors import ChangeoverError

if TYPE_CHECKING:
    from changeover.light import LightSession
    from changeover.settings import Settings

REQUEST_SECONDS = 10.0  # a client hands its request as soon as it connects
SEND_SECONDS = 60.0  # and reads what it is sent: a send to one that stopped reading gives up after this long
STOP_SECONDS = 10.0  # at stop, how long statements still running may take before the agent exits all the same
INTERRUPT_EVERY = 0.25  # a gone client's statement is interrupted this often while it settles, then every second
WATCH_JOIN_SECONDS = 5.0
GONE = "its client went away (Ctrl-C, or the CLI was killed) before the statement started: it was not run"
log = logging.getLogger("changeover.cli.sql_agent")


class ClientGone(ChangeoverError):
    """The client of a statement hung up before it started: it is not started."""


class ClientWatch:
    """Whether a statement's client is still there. A watcher thread wakes when the client hangs up; the statement's
    thread asks `start` right before it runs the statement. Once both the job and the hang-up are known, its
    operations are interrupted by tag until its block ends (`done`)."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.gone = threading.Event()
        self.ended = threading.Event()
        self.job: LightSession | None = None
        self.lock = threading.Lock()
        self.wake, self.woken = socket.socketpair()
        self.thread = threading.Thread(target=self._watch, name="watch-client", daemon=True)

    def __enter__(self) -> ClientWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done()
        self.thread.join(timeout=WATCH_JOIN_SECONDS)
        if not self.thread.is_alive():  # else still in an interrupt call: its sockets go with it
            self.wake.close()
            self.woken.close()

    def done(self) -> None:
        """The statement's block has ended: nothing more to interrupt, whoever hangs up from now on."""
        if not self.ended.is_set():
            self.ended.set()
            with contextlib.suppress(OSError):
                self.wake.send(b"x")

    def hung_up(self) -> bool:
        """The client closed its end: a read finds the end of the stream (or the connection reset)."""
        try:
            readable, _, _ = select.select([self.conn], [], [], 0)
            return bool(readable) and not self.conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except (OSError, ValueError):
            return True

    def went(self) -> bool:
        """Whether the client has gone, by the watcher's word or by a look now (the watcher may not have woken)."""
        if not self.gone.is_set() and self.hung_up():
            self.gone.set()
        return self.gone.is_set()

    def start(self, job: LightSession) -> bool:
        """Right before the statement runs: False if its client has gone (do not start it); else the watcher
        interrupts the job's operations should the client go from now on."""
        with self.lock:
            if self.went():
                return False
            self.job = job
            return True

    def _watch(self) -> None:
        try:
            readable, _, _ = select.select([self.conn, self.woken], [], [])
        except (OSError, ValueError):
            return
        if self.woken in readable or not self.hung_up():
            return  # the statement's block ended first (or the client sent more, which it never does)
        with self.lock:
            self.gone.set()
            job = self.job
        if job is not None and not self.ended.is_set():  # no job yet: `start` sees `gone` and refuses the statement
            log.warning("light job %s: its client went away; interrupting it until its statement ends", job.tag)
            self._interrupt_until_ended(job)

    def _interrupt_until_ended(self, job: LightSession) -> None:
        """interruptTag until the block ends, as `light.interrupt` retries while its job's first operation may not
        have reached the server yet; after INTERRUPT_SETTLE_SECONDS, once a second."""
        from changeover.light.client import INTERRUPT_SETTLE_SECONDS

        settle = time.monotonic() + INTERRUPT_SETTLE_SECONDS
        while True:
            try:
                job.spark.interruptTag(job.tag)
            except Exception as exc:  # noqa: BLE001 - a session already gone has nothing left to interrupt
                log.info("light job %s: nothing interrupted (%s)", job.tag, type(exc).__name__)
            if self.ended.wait(INTERRUPT_EVERY if time.monotonic() < settle else 1.0):
                return


class _Agent:
    def __init__(self, settings: Settings, where: sql_agent.Place, revision: str | None, idle: float) -> None:
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

    def wait_done(self, timeout: float) -> None:
        """Wait for the statements running to end, up to `timeout` s: the handlers' threads are daemons."""
        deadline = time.monotonic() + timeout
        while True:
            with self.state:
                running = self.busy
            if not running:
                return
            if time.monotonic() > deadline:
                log.warning("exiting with %d statements still running: their light jobs end once their heartbeats "
                            "are missed", running)
                return
            time.sleep(0.1)

    def schema_moved(self) -> bool:
        return _revision(self.settings.database_url) != self.revision

    def handle(self, conn: socket.socket) -> None:
        if sql_agent.peer_uid(conn) != os.getuid():
            return
        conn.settimeout(REQUEST_SECONDS)
        try:
            with conn.makefile("rb") as requests:
                line = requests.readline(sql_agent.MAX_REQUEST)
        except TimeoutError:
            log.warning("a client sent no request in %.0f s: hung up on it", REQUEST_SECONDS)
            return
        conn.settimeout(SEND_SECONDS)
        request = json.loads(line) if line.strip() else {}
        if request.get("op") == "stop":
            sql_agent.send(conn, {"stopped": True})
            self.stop()
            return
        if request.get("op") != "sql" or request.get("key") != self.where.key:
            sql_agent.send(conn, {"declined": "not a statement for this agent"})
            return
        with self.working(), ClientWatch(conn) as watch:
            if self.schema_moved():
                sql_agent.send(conn, {"declined": "the registry's schema moved"})
                log.warning("the registry's schema moved: stopping")
                self.stop()
                return
            try:
                sql_agent.send(conn, {"accepted": True})
            except OSError:
                log.warning("a client went away before its statement was taken: not run")
                return
            answer = self.run(request, watch)
            with contextlib.suppress(OSError):  # a client gone (Ctrl-C): its statement was not run, or interrupted
                sql_agent.send(conn, answer)

    def run(self, request: dict[str, Any], watch: ClientWatch) -> dict[str, Any]:
        """The statement as a light job in a session of its own (reuse=False: no `USE`, `SET` or temporary view of
        one command lasts into the next), unless its client has gone before it starts."""
        from pyspark.errors import PySparkException

        from changeover import audit, light
        from changeover.light import ledger
        from changeover.registry.states import LightState

        statement = str(request["statement"])
        what = f"SQL {sql_agent.short(statement)!r}"
        audit.act_as(audit.Acting(str(request["actor"])))  # this thread's: the ledger and the events name the CLI's
        try:
            if watch.went():  # before routing: no light job yet, nothing to record
                raise ClientGone(what, GONE, "run it again")
            try:
                with light.session(self.settings, statement=statement, block_shutdown=bool(request["block_shutdown"]),
                                   shutdown_timeout=int(request["shutdown_timeout"]), tries=int(request["tries"]),
                                   user_id=str(request["user"]), reuse=False) as job:
                    if not watch.start(job):
                        ledger.finish(self.settings, job.tag, LightState.INTERRUPTED, GONE)
                        log.warning("light job %s: %s", job.tag, GONE)
                        raise ClientGone(what, GONE, "run it again")
                    rows = [row.asDict(recursive=True) for row in job.spark.sql(statement).collect()]
            finally:
                watch.done()
            return {"rows": rows, "member": job.route.member, "version": job.route.version}
        except ChangeoverError as exc:
            return {"error": {"refused": exc.refused, "reason": exc.reason, "fix": exc.fix}}
        except PySparkException as exc:
            refusal = sql_agent.spark_refusal(statement, exc)
            return {"error": {"refused": refusal.refused, "reason": refusal.reason, "fix": refusal.fix}}
        except Exception as exc:  # noqa: BLE001 - the CLI says it in one line; the log keeps the stack
            log.exception("statement %r failed", sql_agent.short(statement))
            return {"error": {"refused": what, "reason": f"{type(exc).__name__}: {exc}",
                              "fix": f"see the SQL agent's log: {self.where.log}"}}


def _revision(database_url: str) -> str | None:
    from alembic.runtime.migration import MigrationContext

    from changeover.registry.db import engine_for

    with engine_for(database_url).connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True  # no handler keeps the agent, and its lock, alive: `serve` waits STOP_SECONDS at most
    block_on_close = False
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
    where = sql_agent.place(settings, key)
    if where is None or sql_agent.key_of(settings) != key:
        log.error("the settings or the code this agent was started for changed before it started: exiting")
        return 2
    try:
        lock = sql_agent.open_private(where.lock, "lock")
    except ChangeoverError as exc:
        log.error("%s", exc)
        return 1
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock)
        return 0  # another agent serves these settings
    try:
        return _serve_locked(settings, where, idle)
    finally:
        os.close(lock)  # last: whoever waits for this agent to be gone (`stop_all`) waits for this


def _serve_locked(settings: Settings, where: sql_agent.Place, idle: float | None) -> int:
    import warnings

    warnings.filterwarnings("ignore", message="PySpark does not yet fully support pandas", category=FutureWarning)
    import pyspark.sql.connect.session  # noqa: F401 - loaded now, not on the first statement

    import changeover.light  # noqa: F401 - likewise
    from changeover.registry.schema import require_current

    try:
        require_current(settings.database_url)
    except ChangeoverError as exc:
        log.error("%s", exc)
        return 1
    if idle is None:
        idle = float(os.environ.get("CHANGEOVER_SQL_AGENT_IDLE_SECONDS") or sql_agent.IDLE_SECONDS)
    agent = _Agent(settings, where, _revision(settings.database_url), idle)
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
        agent.wait_done(STOP_SECONDS)
        log.warning("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1]))
