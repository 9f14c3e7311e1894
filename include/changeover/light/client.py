"""The routed session: open it on the chosen server, check the server's version (as Jet's coordinatorVersion
check does), register the light job, run, and record how it ended. A refusal is re-routed, a bounded number of times."""

from __future__ import annotations

import contextlib
import getpass
import logging
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from changeover import audit
from changeover.errors import ChangeoverError
from changeover.light import ledger
from changeover.light.routing import Route, route
from changeover.registry.db import session_scope
from changeover.registry.states import LightState
from changeover.settings import Settings

if TYPE_CHECKING:
    from pyspark.sql.connect.session import SparkSession

log = logging.getLogger("changeover.light")

ROUTE_TRIES = 3
DEFAULT_SHUTDOWN_TIMEOUT = 30
CONNECT_SECONDS = 2.0  # for the server's port: a server gone since routing is refused at once, not after retries
# An interrupt that finds no operation running tries again this long: a job whose session just opened may be about
# to submit its first operation, which an interrupt sent before it reaches the server would miss.
INTERRUPT_SETTLE_SECONDS = 5.0


class VersionChanged(ChangeoverError):
    """The server's version is not the one its group had when the job was routed (a light job's version check)."""


@dataclass
class LightSession:
    """A routed, version-checked Spark Connect session; every operation it starts carries the job's tag."""

    spark: SparkSession
    route: Route
    tag: str
    refusals: list[str]  # why earlier tries were re-routed


# Sessions kept open per server and identity, as a connection pool keeps connections: a light job then costs its
# version check and its own work, not a session's setup. Each use checks the version again.
_pool: dict[tuple[str, str, str], SparkSession] = {}
_pool_lock = threading.Lock()


def open_checked(target: Route, user_id: str, params: str = "", reuse: bool = False) -> SparkSession:
    """A Connect session on the routed server, refused unless the server runs the routed group's version. With
    reuse, a session this process already holds there is checked and reused; a server restarted since (its
    sessions gone, or at another version) fails the check and the session is dropped."""
    key = (target.server, user_id, params)
    if reuse:
        with _pool_lock:
            pooled = _pool.pop(key, None)
        if pooled is not None:
            try:
                found = _server_version(pooled)
            except Exception:  # noqa: BLE001 - a server restarted since: open afresh, checked as any new one
                _close(pooled)
            else:
                _check_version(target, found, pooled)
                return pooled  # lent to this job alone: `give_back` returns it when the job ends
    return _open_new(target, user_id, params)


def close_pool() -> int:
    """Close every pooled session (as an engine's dispose closes its pooled connections), for a process done with
    light jobs: their gRPC channels would otherwise stay open, reconnecting to servers that may be gone, in a process
    that may go on to fork. Returns how many were closed."""
    with _pool_lock:
        pooled = list(_pool.values())
        _pool.clear()
    for spark in pooled:
        _close(spark)
    return len(pooled)


def give_back(target: Route, user_id: str, params: str, spark: SparkSession) -> None:
    """Return a session to the pool once its job ended: one job at a time uses it, so its temporary views and
    settings are never another's mid-job."""
    with _pool_lock:
        if _pool.setdefault((target.server, user_id, params), spark) is spark:
            return
    _close(spark)  # the pool has one for this server already


def _open_new(target: Route, user_id: str, params: str) -> SparkSession:
    from pyspark.sql.connect.client.retries import DefaultPolicy
    from pyspark.sql.connect.session import SparkSession

    try:
        socket.create_connection(_host_port(target.server), timeout=CONNECT_SECONDS).close()
    except OSError as exc:
        raise VersionChanged(f"light job routed to member {target.member}",
                             f"its Connect server at {target.server} does not answer ({exc.strerror or exc})",
                             "it is routed again") from None
    spark = SparkSession.builder.remote(f"{target.server}/;user_id={user_id}{params}").create()
    # a few quick retries: a server that stops while it is asked is another member's job to serve
    spark.client.set_retry_policies([DefaultPolicy(max_retries=3, max_backoff=1000)])
    try:
        found = _server_version(spark)
    except Exception as exc:  # noqa: BLE001 - any failure to answer is a refusal to re-route
        _close(spark)
        raise VersionChanged(f"light job routed to member {target.member}",
                             f"its Connect server at {target.server} did not answer ({type(exc).__name__})",
                             "it is routed again") from None
    _check_version(target, found, spark)
    return spark


def _server_version(spark: SparkSession) -> str:
    """Asked of the server each time: the session's `version` property is cached for the session's life."""
    return str(spark.client._analyze(method="spark_version").spark_version)


def _check_version(target: Route, found: str, spark: SparkSession) -> None:
    if found != target.version:
        _close(spark)
        raise VersionChanged(f"light job routed to member {target.member}",
                             f"it was routed to the Spark {target.version} group, and its server runs Spark {found}: "
                             "the member changed version between routing and execution", "it is routed again")


@contextlib.contextmanager
def session(settings: Settings | None = None, *, statement: str | None = None, block_shutdown: bool = True,
            shutdown_timeout: int = DEFAULT_SHUTDOWN_TIMEOUT, tries: int = ROUTE_TRIES, user_id: str | None = None,
            params: str = "", reuse: bool = False) -> Iterator[LightSession]:
    """`with session() as light: light.spark.sql(...)`: a light job on the largest version group.

    Operations the block starts from this thread carry the job's tag (Connect tags are per thread), so a drain
    past its shutdown timeout, or a killed Airflow task, can interrupt them. block_shutdown (the default, as in
    Jet for SQL and batch work) makes a drain wait for the block instead. With reuse, the session is kept for
    the next light job of this process on that server (its temporary views and settings too): for short SQL.
    """
    settings = settings or Settings.from_env()
    user = user_id or getpass.getuser()
    spark, target, registered, refusals = _open_routed(settings, user, params, statement, block_shutdown,
                                                       shutdown_timeout, tries, reuse)
    spark.addTag(registered.tag)
    outcome, error = LightState.SUCCEEDED, None
    try:
        with ledger.kept_alive(settings, registered.tag):
            yield LightSession(spark, target, registered.tag, refusals)
    except BaseException as exc:
        outcome = LightState.INTERRUPTED if "OPERATION_CANCELED" in str(exc) else LightState.FAILED
        error = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        ledger.finish(settings, registered.tag, outcome, error)
        if reuse and outcome == LightState.SUCCEEDED:
            spark.removeTag(registered.tag)
            give_back(target, user, params, spark)
        else:
            _close(spark)


def _open_routed(settings: Settings, user: str, params: str, statement: str | None, block_shutdown: bool,
                 shutdown_timeout: int, tries: int, reuse: bool
                 ) -> tuple[SparkSession, Route, ledger.Registered, list[str]]:
    refusals: list[str] = []
    avoid: set[str] = set()
    for _ in range(max(1, tries)):
        target = route(settings, exclude=frozenset(avoid))
        try:
            spark = open_checked(target, user, params, reuse)
        except VersionChanged as exc:
            _refused(settings, target, exc, refusals, avoid)
            continue
        try:
            registered = ledger.register(settings, target.member, target.version, target.server,
                                         spark.client._session_id, user, statement=statement,
                                         block_shutdown=block_shutdown, shutdown_timeout=shutdown_timeout)
        except ledger.MemberLeft as exc:
            _close(spark)
            _refused(settings, target, exc, refusals, avoid)
            continue
        return spark, target, registered, refusals
    raise ChangeoverError("light job", f"it was refused {len(refusals)} times: {'; '.join(refusals)}",
                          "retry once the upgrade in progress has moved on, or raise `tries`")


def _refused(settings: Settings, target: Route, exc: ChangeoverError, refusals: list[str], avoid: set[str]) -> None:
    refusals.append(str(exc))
    avoid.add(target.member)
    log.warning("light job refused and re-routed: %s", exc)
    with session_scope(settings.database_url) as s:
        audit.record(s, "light.reroute", "member", target.member, outcome="refused", version=target.version,
                     server=target.server, reason=exc.reason)


def run_sql(settings: Settings | None, statement: str, **options: Any) -> tuple[list[dict[str, Any]], Route]:
    """One SQL statement as a light job: its rows (as dicts) and where it ran."""
    with session(settings, statement=statement, **options) as light:
        rows = [row.asDict(recursive=True) for row in light.spark.sql(statement).collect()]
        return rows, light.route


def interrupt(settings: Settings, tag: str, reason: str, settle: float = INTERRUPT_SETTLE_SECONDS) -> list[str]:
    """Interrupt a running light job's operations by its tag, from another client attached to its session, trying
    again for `settle` seconds while none is running yet. Returns the interrupted operation ids; the job's row ends
    INTERRUPTED either way."""
    from pyspark.sql.connect.session import SparkSession

    job = ledger.get(settings, tag)
    if job.state != LightState.RUNNING:
        return []
    interrupted: list[str] = []
    with contextlib.suppress(OSError):
        socket.create_connection(_host_port(job.server), timeout=CONNECT_SECONDS).close()
        attached = SparkSession.builder.remote(
            f"{job.server}/;user_id={job.user_id};session_id={job.session_id}").create()
        try:
            deadline = time.monotonic() + settle
            interrupted = list(attached.client.interrupt_tag(tag) or [])
            while not interrupted and time.monotonic() < deadline:
                time.sleep(0.25)
                interrupted = list(attached.client.interrupt_tag(tag) or [])
        except Exception as exc:  # noqa: BLE001 - a session already gone has nothing left to interrupt
            log.info("light job %s: nothing to interrupt (%s)", tag, type(exc).__name__)
        finally:
            attached.client.close()  # not stop(): that would release the job's own session
    ledger.finish(settings, tag, LightState.INTERRUPTED, reason)
    log.info("light job %s interrupted (%d operations): %s", tag, len(interrupted), reason)
    return interrupted


def _host_port(server: str) -> tuple[str, int]:
    where = urlparse(server)
    if where.hostname is None or where.port is None:
        raise ChangeoverError(f"Connect server {server!r}", "it is not an sc://host:port address",
                              "record servers as Changeover starts them")
    return where.hostname, where.port


def _close(spark: SparkSession) -> None:
    with contextlib.suppress(Exception):
        spark.stop()
