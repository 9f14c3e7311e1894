"""Every change to a job, member or savepoint writes a structured log line and an event row."""

from __future__ import annotations

import getpass
import json
import logging
import os
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from changeover.registry.db import session_scope
from changeover.registry.models import Event, utcnow

log = logging.getLogger("changeover.audit")


@dataclass(frozen=True)
class Acting:
    actor: str  # the person who triggered the Airflow run, then DAG, run, task and try
    upgrade: str | None = None  # the upgrade the task works for, so `changeover events --upgrade` finds its actions


_acting: ContextVar[Acting | None] = ContextVar("changeover_acting", default=None)


def act_as(acting: Acting) -> None:
    """Name who acts for what follows in this task (a context variable, not the environment: the task's child
    processes and other tasks are not told)."""
    _acting.set(acting)


def acting() -> Acting | None:
    """Who acts here, when a task named it: a task's trigger carries it on (`act_as` in the triggerer)."""
    return _acting.get()


def current_actor() -> str:
    """Who acts: the Airflow task's person and task, a driver's job (CHANGEOVER_ACTOR), or the CLI's user."""
    acting = _acting.get()
    return acting.actor if acting else os.environ.get("CHANGEOVER_ACTOR") or f"cli:{getpass.getuser()}"


def current_upgrade() -> str | None:
    acting = _acting.get()
    return acting.upgrade if acting else None


def record(
    session: Session, action: str, kind: str, subject: str, outcome: str = "ok", **details: Any
) -> Event:
    event = Event(
        at=utcnow(),
        actor=current_actor(),
        action=action,
        subject_kind=kind,
        subject=subject,
        outcome=outcome,
        details=details,
        upgrade=current_upgrade(),
    )
    session.add(event)
    line = {"actor": event.actor, "action": action, kind: subject, "outcome": outcome, **details}
    if event.upgrade:
        line["upgrade"] = event.upgrade
    log.info("audit %s", json.dumps(line, default=str, sort_keys=True))
    return event


def find(
    url: str,
    *,
    job: str | None = None,
    member: str | None = None,
    upgrade: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    limit: int = 50,
) -> list[Event]:
    """Events newest last. A job or member matches as the subject or as the `job`/`member` in the details."""
    query = select(Event).order_by(Event.id.desc())
    if upgrade:
        query = query.where(or_(Event.upgrade == upgrade, Event.subject == upgrade))
    if since:
        query = query.where(Event.at >= since)
    if until:
        query = query.where(Event.at <= until)
    wanted = [("job", job), ("member", member)]
    found: list[Event] = []
    with session_scope(url) as s:
        for event in s.scalars(query):  # details are JSON: matched here, the same way on every database
            if all(value is None or _about(event, kind, value) for kind, value in wanted):
                found.append(event)
                if len(found) >= limit:
                    break
    return found[::-1]


def _about(event: Event, kind: str, name: str) -> bool:
    return (event.subject_kind == kind and event.subject == name) or (event.details or {}).get(kind) == name
