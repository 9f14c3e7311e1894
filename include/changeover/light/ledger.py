"""The registry's record of light jobs: registered under the member's row lock, so a drain that begins at the same
moment either sees the job (and waits for it or interrupts it) or is seen by it (and the job is re-routed)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from changeover import audit
from changeover.errors import ChangeoverError
from changeover.registry.db import lock_row, session_scope
from changeover.registry.models import LightJob, Member, utcnow
from changeover.registry.states import LightState, MemberStatus
from changeover.settings import Settings
from changeover.timeutil import as_utc

STATEMENT_CHARS = 500


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
                       actor=audit.current_actor(), started_at=utcnow())
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


def running_on(settings: Settings, member: str) -> list[LightJob]:
    with session_scope(settings.database_url) as s:
        return list(s.scalars(select(LightJob).where(LightJob.member == member,
                                                     LightJob.state == LightState.RUNNING).order_by(LightJob.id)))


def get(settings: Settings, tag: str) -> LightJob:
    with session_scope(settings.database_url) as s:
        job = s.scalar(select(LightJob).where(LightJob.tag == tag))
        if job is None:
            raise ChangeoverError(f"light job {tag!r}", "the registry has no light job with that tag",
                                  "use a tag from `changeover events --action light.start`")
        return job


def _id_of(s: Session, tag: str) -> int | None:
    return s.scalar(select(LightJob.id).where(LightJob.tag == tag))
