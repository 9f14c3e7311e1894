"""Where a light job goes: a random Connect server of the largest version group, on a tie the higher version."""

from __future__ import annotations

import random
from dataclasses import dataclass

from sqlalchemy import select

from changeover.cluster import connect_server
from changeover.cluster.routing import groups_of, largest_group
from changeover.errors import ChangeoverError
from changeover.registry.db import session_scope
from changeover.registry.models import Member
from changeover.registry.states import MemberStatus
from changeover.settings import Settings


class NoLightServer(ChangeoverError):
    """No ACTIVE member runs a Connect server."""


@dataclass(frozen=True)
class Route:
    member: str
    version: str  # the version group the router chose: the server must report it when the session opens
    server: str  # sc://host:port


def choose(servers: dict[str, tuple[str, str]], rng: random.Random | None = None) -> Route:
    """The routing rule over the serving members (member -> (version, address)): the largest same-version group,
    on a tie the higher version, then a random member of it, so light work spreads over the group."""
    if not servers:
        raise NoLightServer("light job", "no ACTIVE member runs a Spark Connect server",
                            "start members with `changeover cluster up --light-jobs`, or wait for the drain in "
                            "progress to give a member back")
    version = largest_group(groups_of({member: version for member, (version, _) in servers.items()}))
    member = (rng or random).choice(sorted(m for m, (v, _) in servers.items() if v == version))
    return Route(member, version, servers[member][1])


def serving(settings: Settings, exclude: frozenset[str] = frozenset()) -> dict[str, tuple[str, str]]:
    """ACTIVE members whose Connect server the registry records as started. One that died since is found when
    the session opens, and the job re-routed."""
    with session_scope(settings.database_url) as s:
        rows = s.scalars(select(Member).where(Member.status == MemberStatus.ACTIVE, Member.light_jobs.is_(True),
                                              Member.connect_pid.is_not(None)))
        return {m.name: (m.version, connect_server.address(m.host, m.connect_port)) for m in rows
                if m.name not in exclude and m.connect_port is not None}


def route(settings: Settings, exclude: frozenset[str] = frozenset(), rng: random.Random | None = None) -> Route:
    return choose(serving(settings, exclude), rng)
