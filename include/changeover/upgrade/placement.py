"""Upgrade-aware placement: each fault-tolerant job moves at most once in a rolling upgrade, where it can.

The routing rule sends a job to the largest version group. Mid-upgrade that is often the old version,
so a job on the first member drained would move to an old member, then again when that member drains.
Instead the roll drains members hosting no fault-tolerant job first, and a job moved by the upgrade goes
to the version that will be the largest group once the upgrade is done, as soon as that group has an
ACTIVE member. New jobs still follow the largest-group rule (`routing`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import pairwise

from sqlalchemy import select

from changeover.cluster import Membership, routing
from changeover.errors import ChangeoverError
from changeover.jobs import LIVE
from changeover.registry.db import session_scope
from changeover.registry.models import Job, JobRun, Member, UpgradeRun
from changeover.registry.states import MemberStatus, UpgradePhase
from changeover.settings import Settings

CORES_PER_JOB = 2  # a moved job needs room for its driver and one executor, or it waits queued at the master


def jobs_by_member(settings: Settings) -> dict[str, list[str]]:
    """Live fault-tolerant jobs per member, as the registry last saw them (no master is asked)."""
    hosted: dict[str, list[str]] = {}
    with session_scope(settings.database_url) as s:
        rows = s.execute(select(Job.name, JobRun.member).join(JobRun, JobRun.id == Job.current_run_id)
                         .where(Job.fault_tolerant.is_(True), JobRun.state.in_(LIVE)).order_by(Job.name))
        for name, member in rows:
            if member:
                hosted.setdefault(member, []).append(name)
    return hosted


def final_layout(settings: Settings, target: str, upgraded: Iterable[str]) -> dict[str, str]:
    """Every member not stopped, at the version it will have once `upgraded` run `target`."""
    moving = set(upgraded)
    with session_scope(settings.database_url) as s:
        return {m.name: (target if m.name in moving else m.version)
                for m in s.scalars(select(Member).where(Member.status != "STOPPED"))}


def destination(settings: Settings, exclude: Iterable[str], after: dict[str, str] | None = None,
                free_cores: Callable[[str, list[str]], int] | None = None) -> str:
    """Where a job leaving a member goes: the group that will be largest after the upgrade (`after`,
    member -> version) if it has an ACTIVE member now with room for a driver and an executor, else the
    largest group now. `free_cores(version, members)` says how many cores those members have free."""
    groups = routing.version_groups(settings, exclude)
    if after:
        final = routing.largest_group(routing.groups_of(after))
        if groups.get(final) and (free_cores is None or free_cores(final, groups[final]) >= CORES_PER_JOB):
            return final
    return routing.largest_group(groups)


def free_cores_of(settings: Settings, membership: Membership) -> Callable[[str, list[str]], int]:
    """Free cores of members as their group's master reports them; a master that does not answer has none."""
    def free(version: str, members: list[str]) -> int:
        with session_scope(settings.database_url) as s:
            hosts = set(s.scalars(select(Member.host).where(Member.name.in_(members))))
        try:
            return sum(int(w.get("coresfree", 0)) for w in membership.master(version).alive_workers()
                       if w.get("host") in hosts)
        except ChangeoverError:
            return 0
    return free


def upgrade_destination(settings: Settings, exclude: Iterable[str], upgrade_key: str | None,
                        membership: Membership | None = None) -> str:
    """`destination` for a drain that is part of the upgrade `upgrade_key` (none: the largest group now)."""
    after = None
    if upgrade_key is not None:
        with session_scope(settings.database_url) as s:
            run = s.scalar(select(UpgradeRun).where(UpgradeRun.key == upgrade_key))
            target, phases = (run.target_version, dict((run.progress or {}).get("phases", {}))) if run else ("", {})
        if target:
            after = final_layout(settings, target, [m for m, phase in phases.items() if phase != UpgradePhase.SKIPPED])
    return destination(settings, exclude, after, free_cores_of(settings, membership) if membership else None)


@dataclass(frozen=True)
class MovePlan:
    order: list[str]  # members in the order they are drained
    moves: dict[str, list[str]]  # job -> versions it is expected to run on, in turn
    cold: dict[str, list[str | None]] = field(default_factory=dict)  # job -> per move, why it will be cold

    def describe(self) -> list[str]:
        lines = [f"drain order: {', '.join(self.order) or 'none'} (members without fault-tolerant jobs first)"]
        for job, versions in sorted(self.moves.items()):
            count = len(versions) - 1
            lines.append(f"  job {job}: {' -> '.join(versions)} ({count} move{'s' if count != 1 else ''})")
            for (before, after), why in zip(pairwise(versions), self.cold.get(job, []), strict=False):
                how = (f"cold: {why}" if why else f"warm if the {after} group then has {CORES_PER_JOB} free cores "
                       "for its standby, else cold")
                lines.append(f"    {before} -> {after}: {how}")
        return lines


def plan_moves(settings: Settings, target: str, members: list[str]) -> MovePlan:
    """Drain order and each fault-tolerant job's expected moves. A job moves twice only when no member at the
    final largest version is ACTIVE by its member's turn (every member being upgraded hosts a job)."""
    hosted = jobs_by_member(settings)
    order = sorted(members, key=lambda m: len(hosted.get(m, [])))  # stable: the user's order among equals
    with session_scope(settings.database_url) as s:
        now = {m.name: m.version for m in s.scalars(select(Member).where(Member.status == MemberStatus.ACTIVE))}
    final = routing.largest_group(routing.groups_of(final_layout(settings, target, members))) if now else target
    layout, moves = dict(now), {}
    for member in order:
        for job in hosted.get(member, []):
            others = {m: v for m, v in layout.items() if m != member}
            if not others:
                continue
            to = final if final in others.values() else routing.largest_group(routing.groups_of(others))
            moves[job] = [layout.get(member, "?"), to] + ([final] if to != final else [])
        layout[member] = target
    return MovePlan(order, moves)
