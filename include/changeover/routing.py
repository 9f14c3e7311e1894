"""Version groups and where jobs go: the largest group of ACTIVE members, on a tie the higher version."""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import select

from changeover.errors import ChangeoverError
from changeover.registry.db import session_scope
from changeover.registry.models import Member
from changeover.settings import Settings


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def version_groups(settings: Settings, exclude: Iterable[str] = ()) -> dict[str, list[str]]:
    """Members by exact Spark version: a 4.2.1 executor fails tasks of a 4.2.0 driver."""
    skip = set(exclude)
    groups: dict[str, list[str]] = {}
    with session_scope(settings.database_url) as s:
        for m in s.scalars(select(Member).where(Member.status == "ACTIVE").order_by(Member.name)):
            if m.name not in skip:
                groups.setdefault(m.version, []).append(m.name)
    return groups


def largest_group(groups: dict[str, list[str]]) -> str:
    if not groups:
        raise ChangeoverError(
            "job placement", "no ACTIVE member is left to run it", "start members with `changeover cluster up`"
        )
    return max(groups, key=lambda v: (len(groups[v]), version_key(v)))


def target_version(settings: Settings, exclude: Iterable[str] = ()) -> str:
    return largest_group(version_groups(settings, exclude))
