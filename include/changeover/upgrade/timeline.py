"""An upgrade over time, for a person to see at a glance: each member's phases, and each job's commits with its
moves marked. Read from the audit trail (the phases), the runs (their checkpoints' commit files) and the moves."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from sqlalchemy import or_, select

from changeover import audit
from changeover.errors import ChangeoverError
from changeover.jobs import move_history
from changeover.registry.db import session_scope
from changeover.registry.models import Event, JobRun, UpgradeRun
from changeover.runtime import checkpoints
from changeover.settings import Settings
from changeover.timeutil import as_utc

# A member's phase begins with the first action and ends with the second (or the next phase's start).
PHASES = (("draining", "drain.begin", "drain.complete"), ("drained", "drain.complete", "member.upgrade.begin"),
          ("upgrading", "member.upgrade.begin", "member.upgrade"))


@dataclass(frozen=True)
class Span:
    lane: str  # "member m1"
    label: str
    start: datetime
    end: datetime


@dataclass(frozen=True)
class MoveMark:
    job: str
    last_old_commit: datetime
    first_new_commit: datetime | None
    label: str  # "4.2.0 -> 4.3.0 warm, 4.0 s"


@dataclass
class Timeline:
    key: str
    target_version: str
    status: str
    start: datetime
    end: datetime
    spans: list[Span] = field(default_factory=list)
    commits: dict[str, list[datetime]] = field(default_factory=dict)  # job -> commit times in the window
    moves: list[MoveMark] = field(default_factory=list)


def of_upgrade(settings: Settings, key: str, now: datetime | None = None) -> Timeline:
    """The upgrade `key` (DAG id / run id) from its start to its end, or to now while it runs."""
    with session_scope(settings.database_url) as s:
        run = s.scalar(select(UpgradeRun).where(UpgradeRun.key == key))
        if run is None:
            raise ChangeoverError(f"upgrade {key!r}", "no such upgrade", "list them with `changeover upgrades`")
        start = as_utc(run.started_at)
        end = as_utc(run.finished_at) if run.finished_at else (now or datetime.now(UTC))
        timeline = Timeline(key, run.target_version, run.status, start, end)
        runs = list(s.scalars(select(JobRun).where(JobRun.submitted_at <= end,
                                                   or_(JobRun.ended_at.is_(None), JobRun.ended_at >= start))))
        roots = [(r.job, r.checkpoint_root) for r in runs if r.checkpoint_root]
    events = audit.find(settings.database_url, upgrade=key, limit=10_000)
    timeline.spans = _phases(events, end)
    for job, root in roots:
        timeline.commits.setdefault(job, []).extend(_commits(Path(root), start, end))
    for job in sorted(timeline.commits):
        timeline.commits[job].sort()
        for move in move_history.of(settings, job, since=start):
            old_last = _commit_span(settings, move.from_run)[1]
            if old_last is None or old_last > end:
                continue
            new_first = _commit_span(settings, move.to_run)[0]
            downtime = f", {move.downtime:.1f} s" if move.downtime is not None else ""
            timeline.moves.append(MoveMark(job, old_last, new_first,
                                           f"{move.from_version} -> {move.to_version} {move.kind}{downtime}"))
    return timeline


def _phases(events: list[Event], end: datetime) -> list[Span]:
    spans = []
    members = sorted({e.subject for e in events if e.subject_kind == "member"})
    for member in members:
        times: dict[str, datetime] = {}
        for event in events:
            if event.subject_kind == "member" and event.subject == member:
                times.setdefault(event.action, as_utc(event.at))
        for label, begins, ends in PHASES:
            if begins in times:
                spans.append(Span(f"member {member}", label, times[begins], times.get(ends, end)))
    return spans


def _commits(root: Path, start: datetime, end: datetime) -> list[datetime]:
    """Commit times of a run's batches (their commit files), the fewest-committing stage's, within the window."""
    found: list[datetime] | None = None
    for stage in checkpoints.stage_names(root):
        log = root / stage / "commits"
        times = []
        for entry in os.scandir(log) if log.is_dir() else []:
            if entry.name.isdigit():
                at = datetime.fromtimestamp(entry.stat().st_mtime, UTC)
                if start <= at <= end:
                    times.append(at)
        if found is None or len(times) < len(found):
            found = times
    return found or []


def _commit_span(settings: Settings, run_id: int) -> tuple[datetime | None, datetime | None]:
    """A run's first and last commit times, as the registry has them."""
    with session_scope(settings.database_url) as s:
        run = s.get(JobRun, run_id)
        if run is None:
            return None, None
        return (as_utc(run.first_commit_at) if run.first_commit_at else None,
                as_utc(run.last_commit_at) if run.last_commit_at else None)
