"""A job's moves, as its runs record them: each run that took the job over after another, and the job's downtime.

Downtime is measured as the issue of record defines it: from the last commit of the run that gave the job up to
the first commit of the run that took it (unknown until that run commits). Runs that never took the job (a
dismissed standby, a successor fenced off or failed before writing) are not moves.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from functools import cached_property

from sqlalchemy import or_, select

from changeover import audit
from changeover.jobs import freshness
from changeover.registry.db import session_scope
from changeover.registry.models import Event, JobRun
from changeover.settings import Settings
from changeover.timeutil import as_utc


@dataclass(frozen=True)
class Move:
    job: str
    from_run: int
    to_run: int
    from_version: str
    to_version: str
    downtime: float | None  # seconds from the old run's last commit to the new run's first; None before that
    warm: bool  # the new run was a standby, started before the old one stopped
    zero_downtime: bool = False  # that standby followed the old run read-only before it took over
    roots: tuple[str | None, str | None] = (None, None)  # the two runs' checkpoint roots
    from_first_commit: float | None = None  # when the old run first committed as the job's run (POSIX seconds)

    @cached_property
    def freshness(self) -> float | None:
        """The largest arrival-to-commit gap of an input file around it (`freshness`): read from the checkpoints
        when asked, not for every listing of moves."""
        return freshness.of_move(*self.roots)

    @cached_property
    def usual_freshness(self) -> float | None:
        """Its baseline: the old run's usual largest gap a batch before the move, over batches it ran itself
        (`freshness.usual_gap`)."""
        return freshness.usual_before_move(*self.roots, self.from_first_commit)

    @property
    def kind(self) -> str:
        return "zero-downtime" if self.zero_downtime else "warm" if self.warm else "cold"

    def describe(self) -> str:
        how = (f"downtime {self.downtime:.1f} s (last commit of run {self.from_run} to first commit of run "
               f"{self.to_run})" if self.downtime is not None else f"run {self.to_run} has not committed yet")
        fresh = f", an input file's largest wait for the sink {self.freshness:.1f} s" if self.freshness else ""
        if fresh and self.usual_freshness:
            fresh += f" (before it, usually {self.usual_freshness:.1f} s a batch)"
        return f"{self.job} moved {self.from_version} -> {self.to_version} ({self.kind}): {how}{fresh}"


def of(settings: Settings, job: str, since: datetime | None = None) -> list[Move]:
    """The job's moves among its runs launched since `since` (and the run they left), oldest first."""
    with session_scope(settings.database_url) as s:
        took = list(s.scalars(select(JobRun).where(
            JobRun.job == job, or_(JobRun.first_write_at.is_not(None), JobRun.first_commit_at.is_not(None)))
            .order_by(JobRun.id)))
    found = []
    for before, after in zip(took, took[1:], strict=False):
        if since is not None and as_utc(after.submitted_at) < as_utc(since):
            continue
        gap = ((as_utc(after.first_commit_at) - as_utc(before.last_commit_at)).total_seconds()
               if before.last_commit_at and after.first_commit_at else None)
        found.append(Move(job, before.id, after.id, before.spark_version, after.spark_version, gap,
                          after.standby_of is not None, after.following_since is not None,
                          (before.checkpoint_root, after.checkpoint_root),
                          as_utc(before.first_commit_at).timestamp() if before.first_commit_at else None))
    return found


def record(settings: Settings, moves: list[Move], upgrade_key: str | None = None) -> None:
    """Each move's downtime and freshness for `changeover events` (`job.move.freshness`), once: a retried verify or
    summary finds them recorded. upgrade_key: the upgrade that moved them (None: a job's update)."""
    names = sorted({move.job for move in moves})
    with session_scope(settings.database_url) as s:
        recorded = {(e.subject, e.details.get("to_run")) for e in s.scalars(select(Event).where(
            Event.action == "job.move.freshness", Event.subject.in_(names))) if e.details.get("upgrade") == upgrade_key}
        for move in moves:
            if (move.job, move.to_run) not in recorded:
                audit.record(s, "job.move.freshness", "job", move.job, upgrade=upgrade_key, from_run=move.from_run,
                             to_run=move.to_run, move=move.kind, downtime_seconds=move.downtime,
                             largest_gap_seconds=move.freshness, usual_gap_seconds=move.usual_freshness)
