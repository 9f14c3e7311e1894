"""Version groups and where jobs go: the largest group of ACTIVE members, on a tie the higher version."""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import select

from changeover.errors import ChangeoverError
from changeover.registry.db import session_scope
from changeover.registry.models import Member
from changeover.registry.states import MemberStatus
from changeover.settings import Settings


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def version_groups(settings: Settings, exclude: Iterable[str] = ()) -> dict[str, list[str]]:
    """Members by exact Spark version: a 4.2.1 executor fails tasks of a 4.2.0 driver."""
    skip = set(exclude)
    with session_scope(settings.database_url) as s:
        layout = {m.name: m.version for m in s.scalars(select(Member).where(Member.status == MemberStatus.ACTIVE))
                  if m.name not in skip}
    return groups_of(layout)


def groups_of(layout: dict[str, str]) -> dict[str, list[str]]:
    """Members (member -> version) grouped by version, each group in name order."""
    groups: dict[str, list[str]] = {}
    for member, version in sorted(layout.items()):
        groups.setdefault(version, []).append(member)
    return groups


def largest_group(groups: dict[str, list[str]]) -> str:
    if not groups:
        raise ChangeoverError(
            "job placement", "no ACTIVE member is left to run it", "start members with `changeover cluster up`"
        )
    return max(groups, key=lambda v: (len(groups[v]), version_key(v)))


def target_version(settings: Settings, exclude: Iterable[str] = ()) -> str:
    return largest_group(version_groups(settings, exclude))
