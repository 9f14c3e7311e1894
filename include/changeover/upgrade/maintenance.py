"""Members marked for maintenance: the drain window DAG drains and upgrades these, in name order."""

from __future__ import annotations

from sqlalchemy import select

from changeover import audit
from changeover.cluster import get_member
from changeover.registry.db import session_scope
from changeover.registry.models import Member
from changeover.settings import Settings


def mark(settings: Settings, member: str, reason: str) -> None:
    with session_scope(settings.database_url) as s:
        row = get_member(s, member)
        if row.maintenance != reason:
            row.maintenance = reason
            audit.record(s, "member.maintenance.mark", "member", member, reason=reason)


def unmark(settings: Settings, member: str, why: str) -> None:
    with session_scope(settings.database_url) as s:
        row = get_member(s, member)
        if row.maintenance is not None:
            row.maintenance = None
            audit.record(s, "member.maintenance.unmark", "member", member, reason=why)


def marked(settings: Settings) -> list[str]:
    with session_scope(settings.database_url) as s:
        return list(s.scalars(select(Member.name).where(Member.maintenance.is_not(None)).order_by(Member.name)))
