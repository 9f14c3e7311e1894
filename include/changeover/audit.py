"""Every change to a job, member or savepoint writes a structured log line and an event row."""

from __future__ import annotations

import getpass
import json
import logging
import os
from typing import Any

from sqlalchemy.orm import Session

from changeover.registry.models import Event, utcnow

log = logging.getLogger("changeover.audit")


def current_actor() -> str:
    return os.environ.get("CHANGEOVER_ACTOR") or f"cli:{getpass.getuser()}"


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
    )
    session.add(event)
    line = {"actor": event.actor, "action": action, kind: subject, "outcome": outcome, **details}
    log.info("audit %s", json.dumps(line, default=str, sort_keys=True))
    return event
