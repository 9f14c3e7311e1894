"""The registry's record of light jobs: registered under the member's row lock, so a drain that begins at the same
moment either sees the job (and waits for it or interrupts it) or is seen by it (and the job is re-routed)."""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from changeover import audit
from changeover.errors import ChangeoverError
from changeover.registry.db import lock_row, session_scope
from changeover.registry.models import LightJob, Member, utcnow
from changeover.registry.states import LightState, MemberStatus
from changeover.settings import Settings
from changeover.timeutil import as_utc

log = logging.getLogger("changeover.light")

STATEMENT_CHARS = 500
HEARTBEAT_SECONDS = 5.0  # how often a running light job's client says it is still there
# Eighteen missed heartbeats: the client is gone (killed, or its host lost), and its job with it as far as a drain
# goes. Longer than SQLite's busy timeout (60 s), which a heartbeat may wait out beside a long write.
SILENCE_SECONDS = 90.0


class MemberLeft(ChangeoverError):
    """The routed member stopped serving (a drain began, or its version changed) before the job was registered."""


@dataclass(frozen=True)
class Registered:
    id: int
    tag: str
    member: str
    version: str


def new_tag() -> str:
    return f"changeover-light-{uuid.uuid4().hex[:16]}"


def register(settings: Settings, member: str, version: str, server: str, session_id: str, user_id: str, *,
             statement: str | None, block_shutdown: bool, shutdown_timeout: int, tag: str | None = None
             ) -> Registered:
    """Record a light job about to run on `member`, if it still serves at `version`; else MemberLeft."""
    with session_scope(settings.database_url) as s:
        row = lock_row(s, Member, member)
        if row is None or row.status != MemberStatus.ACTIVE or row.version != version or row.connect_pid is None:
            found = "gone" if row is None else f"{row.status} at Spark {row.version}"
            raise MemberLeft(f"light job on member {member}", f"the member was routed to at Spark {version}, and is "
                             f"now {found}", "it is routed again to the largest version group")
        job = LightJob(tag=tag or new_tag(), member=member, spark_version=version, server=server,
                       session_id=session_id, user_id=user_id, statement=(statement or "")[:STATEMENT_CHARS] or None,
                       block_shutdown=block_shutdown, shutdown_timeout=shutdown_timeout, state=LightState.RUNNING,
                       actor=audit.current_actor(), started_at=utcnow(), heartbeat_at=_clock(s),
                       server_pid=row.connect_pid, server_pid_started=row.connect_pid_started)
        s.add(job)
        s.flush()
        audit.record(s, "light.start", "light_job", job.tag, member=member, version=version, server=server,
                     block_shutdown=block_shutdown, statement=job.statement)
        return Registered(job.id, job.tag, member, version)


def finish(settings: Settings, tag: str, state: LightState, error: str | None = None) -> bool:
    """End a light job's row, once: False if something else (a drain's interrupt) ended it first."""
    with session_scope(settings.database_url) as s:
        job = lock_row(s, LightJob, _id_of(s, tag))
        if job is None or job.state != LightState.RUNNING:
            return False
        job.state, job.error, job.ended_at = state, error, utcnow()
        seconds = round((job.ended_at - as_utc(job.started_at)).total_seconds(), 3)
        audit.record(s, "light.end", "light_job", tag, outcome="ok" if state == LightState.SUCCEEDED else state.lower(),
                     member=job.member, version=job.spark_version, seconds=seconds,
                     **({"error": error[:500]} if error else {}))
        return True


def _clock(s: Session) -> Any:
    """Heartbeats are stamped and judged by the registry's clock where it has one (PostgreSQL), so clients and
    drains on hosts whose clocks differ agree on a silence; SQLite's registry is one host's, and so is its clock."""
    return func.now() if s.get_bind().dialect.name == "postgresql" else utcnow()


def registry_now(settings: Settings) -> datetime:
    """Now, by the clock heartbeats are stamped with."""
    with session_scope(settings.database_url) as s:
        clock = _clock(s)
        return as_utc(s.scalar(select(clock))) if not isinstance(clock, datetime) else clock


def heartbeat(settings: Settings, tag: str) -> bool:
    """The client is still there: False once the row has ended (a drain or the leak checker ended it)."""
    with session_scope(settings.database_url) as s:
        done = s.execute(update(LightJob).where(LightJob.tag == tag, LightJob.state == LightState.RUNNING)
                         .values(heartbeat_at=_clock(s)))
        return bool(done.rowcount)


@contextlib.contextmanager
def kept_alive(settings: Settings, tag: str, every: float = HEARTBEAT_SECONDS) -> Iterator[None]:
    """Heartbeat the job's row from a background thread while the block runs."""
    done = threading.Event()

    def beat() -> None:
        while not done.wait(every):
            try:
                if not heartbeat(settings, tag):
                    return  # ended by someone else: nothing left to keep alive
            except Exception as exc:  # noqa: BLE001 - a registry away for a moment: the next beat tries again
                log.warning("light job %s: heartbeat not written (%s)", tag, type(exc).__name__)

    beating = threading.Thread(target=beat, name=f"heartbeat-{tag}", daemon=True)
    beating.start()
    try:
        yield
    finally:
        done.set()
        beating.join(timeout=max(every, HEARTBEAT_SECONDS))


def why_gone(job: LightJob, member: Member | None, server_running: bool, now: datetime) -> str | None:
    """Why a RUNNING light job runs no longer, as far as its row can tell; None while it may still run. Its session
    lives in its member's Connect server, and the job in its client. `now` is `registry_now()`'s."""
    if member is None:
        return f"light job {job.tag}'s member {job.member} is no longer in the registry"
    if member.version != job.spark_version:  # a member runs one server, at its version: the job's went
        return (f"light job {job.tag} ran on member {job.member}'s Connect server at Spark {job.spark_version}, and "
                f"the member is now at {member.version}")
    if not server_running:
        return f"light job {job.tag} is RUNNING, and member {job.member}'s Connect server is not"
    if job.server_pid is not None and (job.server_pid, job.server_pid_started) != (member.connect_pid,
                                                                                  member.connect_pid_started):
        return (f"light job {job.tag} ran on member {job.member}'s Connect server process {job.server_pid}, which was "
                f"restarted since (now process {member.connect_pid}): the job's session went with it")
    if job.heartbeat_at is not None:  # rows from before heartbeats have none: their servers' checks decide
        silent = (now - as_utc(job.heartbeat_at)).total_seconds()
        if silent > SILENCE_SECONDS:
            return (f"light job {job.tag}'s client has not been heard from for {silent:.0f} s (it heartbeats every "
                    f"{HEARTBEAT_SECONDS:.0f} s): the client is gone")
    return None


def gone(settings: Settings, jobs: list[LightJob], server_running: Callable[[str], bool]
         ) -> list[tuple[LightJob, str | None]]:
    """Each RUNNING job with why it runs no longer (None while it may still run): its members read once, each
    member's server asked once, and one reading of the registry's clock for all."""
    if not jobs:
        return []
    names = {job.member for job in jobs}
    with session_scope(settings.database_url) as s:
        members = {m.name: m for m in s.scalars(select(Member).where(Member.name.in_(names)))}
    running = {name: name in members and server_running(name) for name in names}
    now = registry_now(settings)
    return [(job, why_gone(job, members.get(job.member), running[job.member], now)) for job in jobs]


def running_on(settings: Settings, member: str) -> list[LightJob]:
    with session_scope(settings.database_url) as s:
        return list(s.scalars(select(LightJob).where(LightJob.member == member,
                                                     LightJob.state == LightState.RUNNING).order_by(LightJob.id)))


def recent(settings: Settings, running_only: bool = True, limit: int = 50) -> list[LightJob]:
    """Light jobs, newest first: the running ones, or the last `limit` of any state."""
    query = select(LightJob).order_by(LightJob.id.desc()).limit(limit)
    if running_only:
        query = query.where(LightJob.state == LightState.RUNNING)
    with session_scope(settings.database_url) as s:
        return list(s.scalars(query))


def get(settings: Settings, tag: str) -> LightJob:
    with session_scope(settings.database_url) as s:
        job = s.scalar(select(LightJob).where(LightJob.tag == tag))
        if job is None:
            raise ChangeoverError(f"light job {tag!r}", "the registry has no light job with that tag",
                                  "use a tag from `changeover events --action light.start`")
        return job


def _id_of(s: Session, tag: str) -> int | None:
    return s.scalar(select(LightJob.id).where(LightJob.tag == tag))
