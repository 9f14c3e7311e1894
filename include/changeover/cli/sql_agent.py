"""`changeover sql`'s agent: a background process per home and settings that keeps Spark Connect's client loaded
between commands. This module is the CLI's half (the standard library only); `sql_agent_server` is the agent's.

A `changeover sql` that ran its statement itself would spend seconds importing Spark Connect's client (pandas,
pyarrow, gRPC), SQLAlchemy and Alembic before it asked the server anything, and as long again the next time. From
a terminal, the first `changeover sql` starts this agent instead (detached, in a session of its own, its log beside
its socket), and every `changeover sql` hands it the statement over a Unix socket that only its user can open, then
prints the rows it answers. The agent runs each statement as any light job runs (routed to the largest version
group, version-checked, registered in the ledger under the CLI's user and actor, heartbeated, interruptible by its
tag), each in a Spark session of its own, as the CLI's own process would: a `USE`, a `SET` or a temporary view
lasts one statement, never the next command's. A client that goes away before the answer (Ctrl-C) has its
statement not started, or, started, interrupted until it ends.

The agent exits after IDLE_SECONDS without a statement (CHANGEOVER_SQL_AGENT_IDLE_SECONDS), at
`changeover cluster down`, and when the registry's schema moves under it. Its socket's name holds a digest of the
settings (the registry's password left out), of the code and of the environment that shapes a session, so a CLI
whose settings or code differ starts an agent of its own, and the other one idles out. A command whose standard
input is not a terminal (a script's, CI's) runs the statement itself unless CHANGEOVER_SQL_AGENT=1;
`changeover sql --no-agent` (or CHANGEOVER_SQL_AGENT=0) always does.
"""

from __future__ import annotations

import contextlib
import errno
import getpass
import hashlib
import json
import os
import re
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from changeover.errors import ChangeoverError

if TYPE_CHECKING:
    from changeover.settings import Settings

IDLE_SECONDS = 600.0
START_SECONDS = 120.0  # a new agent's imports take seconds on an idle machine, far longer on a busy one
# A spawned agent that found the lock held (another agent starting, stopping, or stuck) and no socket opened in
# this long: the CLI runs the statement itself rather than wait.
HELD_SECONDS = 5.0
ACCEPT_SECONDS = 30.0  # for the agent to take a statement (it checks the registry's schema first)
MAX_SOCKET_PATH = 100  # a Unix socket's path holds at most 107 bytes
MAX_REQUEST = 1 << 20
SWITCH = "CHANGEOVER_SQL_AGENT"
# What shapes a session besides the settings: a CLI run with other values of these gets an agent of its own.
ENV_PREFIXES = ("SPARK_", "PYSPARK_", "GRPC_")
ENV_PROXIES = ("http_proxy", "https_proxy", "no_proxy", "grpc_proxy", "all_proxy")
ENV_NAMES = ("TZ", "CHANGEOVER_FAULTS", "CHANGEOVER_CRASH_AT")  # a session's time zone; the tests' fault points
PEERCRED = struct.Struct("iII")  # struct ucred: pid_t (signed), uid_t and gid_t (unsigned: uids above 2**31 exist)
PACKAGE = Path(__file__).resolve().parents[1]
# A URL's password as SQLAlchemy parses it (`sqlalchemy.engine.url`'s pattern): after the user name's colon, up to
# the first @; and a driver's password given in the query.
_PASSWORD = re.compile(r"^(?P<head>[\w+]+://[^:/]*:)(?P<password>[^@]*)(?=@)")
_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&]*", re.IGNORECASE)


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


def enabled(force: bool = False) -> bool:
    """Whether a `changeover sql` goes through the agent: where Unix sockets tell their peer's user, when asked
    (force, or CHANGEOVER_SQL_AGENT=1), never with CHANGEOVER_SQL_AGENT=0, and else only from a terminal: a script
    or CI (its standard input not a TTY) starts no process that outlives it unless it asks for one."""
    if not (hasattr(socket, "AF_UNIX") and hasattr(socket, "SO_PEERCRED")):
        return False
    switch = os.environ.get(SWITCH, "")
    if force or switch not in ("", "0"):
        return True
    return switch == "" and _interactive()


def _interactive() -> bool:
    try:
        return os.isatty(0)
    except OSError:
        return False


def hide_password(url: str) -> str:
    """The URL with its password as ***, as SQLAlchemy's `render_as_string(hide_password=True)` shows it (and a
    `password=` in its query hidden too), with the standard library alone, which is all this half loads."""
    return _QUERY_PASSWORD.sub(r"\1***", _PASSWORD.sub(r"\g<head>***", url, count=1))


def key_of(settings: Settings) -> str:
    """A digest of what the agent's sessions depend on: the interpreter, the settings (the registry's URL without
    its password: the digest is in the agent's command line, which any user may read), the environment that shapes
    a session, and this package's code (each file's path, size and time)."""
    digest = hashlib.sha256()
    for part in (sys.executable, str(settings.home), hide_password(settings.database_url), str(settings.runtimes_dir),
                 str(settings.cluster_file), str(settings.rest_key_file)):
        digest.update(part.encode() + b"\0")
    for name in sorted(os.environ):
        if name.startswith(ENV_PREFIXES) or name.lower() in ENV_PROXIES or name in ENV_NAMES:
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


def open_private(path: Path, what: str, create: bool = True) -> int:
    """The agent's log or lock, opened for appending (created 0600 where missing), never through a link, and only
    if it is a regular file of this user's; else a refusal. (OSError if it is missing and not to be created.)"""
    flags = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | (os.O_CREAT if create else 0)
    try:
        descriptor = os.open(path, flags, 0o600)  # O_NONBLOCK: a FIFO put there is refused, not waited on
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENXIO):
            raise
        why = "it is a symbolic link" if exc.errno == errno.ELOOP else "it is not a regular file"
        raise _unsafe(path, what, why) from None
    found = os.fstat(descriptor)
    why = ("it is not a regular file" if not stat.S_ISREG(found.st_mode) else
           f"it belongs to user id {found.st_uid}, not to you ({os.getuid()})" if found.st_uid != os.getuid() else "")
    if why:
        os.close(descriptor)
        raise _unsafe(path, what, why)
    os.set_blocking(descriptor, True)
    if found.st_mode & 0o077:
        os.fchmod(descriptor, 0o600)
    return descriptor


def _unsafe(path: Path, what: str, why: str) -> ChangeoverError:
    return ChangeoverError(f"the SQL agent's {what} {path}", f"{why}, and the agent only writes a file of its own "
                           "there (another one may have been put in its place to make it write elsewhere)",
                           f"remove it (`rm {path}`) and run the command again, or use `changeover sql --no-agent`")


def peer_uid(conn: socket.socket) -> int:
    _pid, uid, _gid = PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))
    return int(uid)


def _connect(path: Path, timeout: float) -> socket.socket | None:
    """A connection to the agent at `path` if one listens there and runs as this user."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(timeout)
        conn.connect(str(path))
        if peer_uid(conn) != os.getuid():
            raise OSError("the socket's owner is another user")
    except OSError:
        conn.close()
        return None
    conn.settimeout(None)
    return conn


def send(conn: socket.socket, message: dict[str, Any]) -> None:
    conn.sendall(json.dumps(message, default=str).encode() + b"\n")


def _note(message: str) -> None:
    print(f"note: {message}", file=sys.stderr, flush=True)


# -- the CLI's half ------------------------------------------------------------------------------------------------
def run_sql(settings: Settings, statement: str, *, block_shutdown: bool, shutdown_timeout: int, tries: int,
            force: bool = False) -> dict[str, Any] | None:
    """The statement run by the agent, started if none serves these settings: {"rows", "member", "version"}. None
    when no agent took the statement (none is wanted (`enabled`) or could start, or it declined it): the caller then
    runs it itself. A refusal (routing, a version check, Spark's answer) raises ChangeoverError as in the CLI's own
    process. force: an explicit --agent, whatever the terminal and CHANGEOVER_SQL_AGENT say."""
    where = place(settings) if enabled(force) else None
    if where is None:
        return None
    conn = _connect(where.socket, 2.0) or _start(settings, where)
    if conn is None:
        return None
    with conn, conn.makefile("rb") as answers:
        try:
            send(conn, {"op": "sql", "key": where.key, "statement": statement, "block_shutdown": block_shutdown,
                        "shutdown_timeout": shutdown_timeout, "tries": tries, "actor": actor(),
                        "user": getpass.getuser()})
            conn.settimeout(ACCEPT_SECONDS)
            accepted = answers.readline()
        except TimeoutError:  # hanging up now is safe: an agent whose client is gone does not start its statement
            _note(f"the SQL agent did not take the statement in {ACCEPT_SECONDS:.0f} s (its log: {where.log}); "
                  "running it in this process")
            return None
        except OSError:
            accepted = b""
        if not accepted or "accepted" not in json.loads(accepted):
            return None  # declined, or gone (stopping as it was asked) before it took the statement: it did not run
        try:
            conn.settimeout(None)
            line = answers.readline()
        except OSError:
            line = b""
    if not line:
        raise ChangeoverError(f"SQL {short(statement)!r}", "the SQL agent went away before it answered, and the "
                              f"statement may have run (its log: {where.log})",
                              "see how it ended with `changeover light list --all`, then run it again if need be")
    answer = json.loads(line)
    if "error" in answer:
        raise ChangeoverError(**answer["error"])
    return dict(answer)


def _start(settings: Settings, where: Place) -> socket.socket | None:
    """Start an agent for these settings and wait for its socket; None if it failed (its log says why), or if
    another agent holds the lock and opens no socket within HELD_SECONDS (starting slowly, stopping, or stuck)."""
    env = agent_env(settings)
    deadline = time.monotonic() + START_SECONDS
    held_since: float | None = None
    agent = _spawn(where, env)
    while agent is not None and time.monotonic() < deadline:
        conn = _connect(where.socket, 1.0)
        if conn is not None:
            return conn
        exited = agent.poll()
        if exited == 0:  # another agent holds the lock: it serves soon, or it is stopping and lets go of it
            held_since = held_since or time.monotonic()
            if time.monotonic() - held_since > HELD_SECONDS:
                _note(f"another SQL agent holds {where.lock} and opened no socket in {HELD_SECONDS:.0f} s (its log: "
                      f"{where.log}); running the statement in this process")
                return None
            time.sleep(0.5)
            agent = _spawn(where, env)
        elif exited is not None:
            return None
        else:
            time.sleep(0.05)
    return None


def agent_env(settings: Settings) -> dict[str, str]:
    """The agent's environment: this one, with the settings as every child process gets them (the registry's URL by
    reference: a file only this user can read), and without CHANGEOVER_DATABASE_URL, whose password would otherwise
    sit in the agent's environment for as long as it runs."""
    return {**{name: value for name, value in os.environ.items() if name != "CHANGEOVER_DATABASE_URL"},
            **settings.as_env()}


def _spawn(where: Place, env: dict[str, str]) -> subprocess.Popen[bytes] | None:
    descriptor = open_private(where.log, "log")
    try:
        return subprocess.Popen([sys.executable, "-m", "changeover.cli.sql_agent_server", where.key], env=env,
                                cwd=where.socket.parent, stdin=subprocess.DEVNULL, stdout=descriptor,
                                stderr=subprocess.STDOUT, start_new_session=True)
    except OSError:
        return None
    finally:
        os.close(descriptor)


def stop_all(settings: Settings, wait: float = 15.0) -> int:
    """Ask every agent of this home to stop (`changeover cluster down`), and wait up to `wait` s for them to be gone
    (each lets go of its lock last); returns how many were asked."""
    import fcntl

    asked: list[Path] = []
    for folder in _folders(settings):
        for path in folder.glob(f"sql-agent-{_home_tag(settings)}-*.sock"):
            conn = _connect(path, 2.0)
            if conn is not None:
                with conn, contextlib.suppress(OSError):
                    conn.settimeout(wait)
                    send(conn, {"op": "stop"})
                    conn.recv(1024)
                    asked.append(path.with_suffix(".lock"))
    deadline = time.monotonic() + wait
    for lock in asked:
        with contextlib.suppress(OSError, ChangeoverError):  # no lock, or not one to trust: nothing to wait on
            descriptor = open_private(lock, "lock", create=False)
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


def short(statement: str, chars: int = 60) -> str:
    flat = " ".join(statement.split())
    return flat if len(flat) <= chars else flat[:chars - 3] + "..."


def spark_refusal(statement: str, exc: BaseException) -> ChangeoverError:
    """Spark's answer to a statement it did not run, as a one-line refusal (its first line: the rest is the
    server's stack)."""
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return ChangeoverError(f"SQL {short(statement)!r}", f"Spark answered {type(exc).__name__}: {first}",
                           "correct the statement, or run it again if it was interrupted (`changeover light list "
                           "--all` says how each light job ended)")
