"""Engine and sessions. SQLite gets WAL and a busy timeout, because drivers, tasks and the CLI share it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Engine, create_engine, event, select, text, update
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

# The kinds a database that is restarting, failing over or busy raises; `transient` tells which of them will clear.
TRANSIENT: tuple[type[Exception], ...] = (OperationalError, InterfaceError)
# shut down, cannot connect now, serialization conflicts, and a fence's row lock not granted within LOCK_WAIT_SECONDS
_RETRYABLE_SQLSTATES = ("57P01", "57P02", "57P03", "40001", "40P01", "55P03")
_BUSY_WORDS = ("database is locked", "database is busy")  # SQLite: a lock not granted within its busy timeout
# What a server that is away for a while says (psycopg gives a failed connect no SQLSTATE); a FATAL such as a
# missing database or role, or a password refused, is not among them.
_AWAY_WORDS = ("connection refused", "could not connect", "the database system is starting up",
               "the database system is shutting down", "the database system is in recovery mode",
               "too many clients", "server closed the connection", "connection timeout expired",
               "timeout expired")


def away(exc: BaseException) -> bool:
    """The database did not answer: a connection lost or refused, a server shutting down or starting. Not a lock
    wait or a conflict, which a database that answers raises."""
    if not transient(exc):
        return False
    if exc.connection_invalidated:  # type: ignore[attr-defined]
        return True
    state = getattr(exc.orig, "sqlstate", None)  # type: ignore[attr-defined]
    if state:
        return state.startswith(("08", "57P"))
    return not any(word in str(exc.orig).lower() for word in _BUSY_WORDS)  # type: ignore[attr-defined]


def transient(exc: BaseException) -> bool:
    """A connection lost or refused, the server shutting down or starting, SQLite busy: the same call succeeds once
    the database is back. Not a missing table, a bad password or a statement error, which retrying never clears."""
    if not isinstance(exc, TRANSIENT):
        return False
    if exc.connection_invalidated:
        return True
    state = getattr(exc.orig, "sqlstate", None)
    if state:
        return state.startswith("08") or state in _RETRYABLE_SQLSTATES
    text = str(exc.orig).lower()
    return any(word in text for word in (*_AWAY_WORDS, *_BUSY_WORDS))
# What a database says that no waiting clears: a refused password or role, a missing database, a read-only one.
_REFUSAL_SQLSTATES = ("28P01", "28000", "3D000", "25006", "42501")
_REFUSAL_WORDS = ("password authentication failed", "no password supplied", "does not exist",
                  "unable to open database file",
                  "readonly database", "read-only")


def refused(exc: BaseException) -> bool:
    """The database answered no, for good (the contrary of `transient` for a caller that would rather wait out
    whatever else it cannot name: an unreachable network, a timeout, a server taking over)."""
    if not isinstance(exc, TRANSIENT) or exc.connection_invalidated:
        return False
    state = getattr(exc.orig, "sqlstate", None)
    if state:
        return state in _REFUSAL_SQLSTATES
    text = str(exc.orig).lower()
    return any(word in text for word in _REFUSAL_WORDS)


REGISTRY_PATIENCE_SECONDS = 600.0
# How long a write waits for the fence's row lock (PostgreSQL's lock_timeout; SQLite's busy timeout is the same
# 60 s): a holder stuck inside the fence (a files commit on a hung mount) then shows as retries in its waiters' logs.
LOCK_WAIT_SECONDS = 60.0
T = TypeVar("T")
log = logging.getLogger("changeover.registry")

_cached_urls: set[str] = set()


@lru_cache(maxsize=8)
def engine_for(url: str) -> Engine:
    _cached_urls.add(url)
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 60})

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA busy_timeout=60000")
            cursor.close()

        return engine
    # A server that stops answering (a black-holed network, a half-open connection) fails a call within about
    # 25 s instead of hanging it (keepalives while idle, tcp_user_timeout for data sent and never acknowledged):
    # a driver's waits, and its self-fencing, run on failed calls.
    args = {"connect_timeout": 10, "keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5,
            "keepalives_count": 3, "tcp_user_timeout": 25000} if url.startswith("postgresql+psycopg") else {}
    return create_engine(url, pool_pre_ping=True, pool_size=2, max_overflow=4, connect_args=args)


def patiently(call: Callable[[], T], what: str, patience: float = REGISTRY_PATIENCE_SECONDS,
              while_waiting: Callable[[BaseException], None] | None = None) -> T:
    """Run `call` until the database answers, for up to `patience` s: for a driver's registry calls and its sink's
    writes, which must outlast a database restart rather than fail the job. Each retry is logged, and
    `while_waiting` runs before each pause with the error (a driver fences itself there)."""
    deadline, pause = time.monotonic() + patience, 0.5
    while True:
        try:
            return call()
        except TRANSIENT as exc:
            if not transient(exc) or time.monotonic() + pause > deadline:
                raise
            log.warning("%s: the database did not answer (%s); retrying in %.1f s", what,
                        str(exc).splitlines()[0], pause)
            if while_waiting is not None:
                while_waiting(exc)
            time.sleep(pause)
            pause = min(pause * 2, 5.0)


@contextmanager
def session_scope(url: str) -> Iterator[Session]:
    """A short transaction: commit on success, roll back on error."""
    session = sessionmaker(engine_for(url), expire_on_commit=False)()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def forget_engines() -> None:
    """Close pooled connections, e.g. after the database file was deleted and must be opened anew."""
    for url in list(_cached_urls):
        engine_for(url).dispose()
    engine_for.cache_clear()
    _cached_urls.clear()


def lock_row(session: Session, model: type[Any], key: Any) -> Any:
    """Load one row for update, so that two writers deciding on it are serialised.

    PostgreSQL takes a row lock. SQLite ignores FOR UPDATE, so a no-op write first takes the database's
    write lock (waiting out the busy timeout) before the row is read: no decision is made on a stale read.
    """
    if session.get_bind().dialect.name == "sqlite":
        table = model.__table__
        pk = table.primary_key.columns.values()[0]
        session.execute(update(table).where(pk == key).values({pk.name: pk}))
    return session.get(model, key, with_for_update=True, populate_existing=True)


def bound_lock_waits(session: Session) -> None:
    """This transaction's lock waits end after LOCK_WAIT_SECONDS with an error `patiently` retries (SQLSTATE 55P03).
    SQLite's busy timeout bounds every connection's already."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text(f"SET LOCAL lock_timeout = '{int(LOCK_WAIT_SECONDS * 1000)}ms'"))


def lock_all(session: Session, model: type[Any]) -> list[Any]:
    """Load every row of a small table for update, in key order, so deciders over the whole set (one member
    drained at a time) are serialised without deadlocking each other. SQLite: the database's write lock."""
    table = model.__table__
    pk = table.primary_key.columns.values()[0]
    if session.get_bind().dialect.name == "sqlite":
        session.execute(update(table).values({pk.name: pk}))
    query = select(model).order_by(pk).with_for_update()
    return list(session.scalars(query, execution_options={"populate_existing": True}))
