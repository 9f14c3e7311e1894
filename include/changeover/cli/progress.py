"""An upgrade's progress as a person follows it: a bar of members done, each member's phase, each job's moves and
their downtime. `changeover upgrade status KEY --follow` shows it live; the demo prints what changes. Fits in an
80-column terminal."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rich.console import Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
from rich.table import Table
from sqlalchemy import select

from changeover.errors import ChangeoverError
from changeover.jobs import move_history
from changeover.registry.db import session_scope
from changeover.registry.models import Job, UpgradeRun
from changeover.settings import Settings
from changeover.upgrade import recovery

log = logging.getLogger(__name__)
DONE_PHASES = ("UPGRADED", "SKIPPED")


@dataclass(frozen=True)
class Snapshot:
    status: str
    target_version: str
    members: list[dict[str, Any]]  # name, phase, status, version
    moves: list[str]  # "clicks 4.2.0 -> 4.3.0 warm, down 4.0 s"

    @property
    def done(self) -> int:
        return sum(1 for m in self.members if m["phase"] in DONE_PHASES)

    def lines(self) -> list[str]:
        """One line per member and per move, for printing what changed."""
        return [*(f"member {m['name']}: {m['phase'].lower()}, {m['status']} at {m['version']}" for m in self.members),
                *(f"move: {move}" for move in self.moves)]


def snapshot(settings: Settings, key: str) -> Snapshot:
    found = recovery.status(settings, key)
    with session_scope(settings.database_url) as s:
        started = s.scalar(select(UpgradeRun.started_at).where(UpgradeRun.key == key))
        names = list(s.scalars(select(Job.name).order_by(Job.name)))
    moves = []
    for job in names:
        for move in move_history.of(settings, job, since=started):
            down = f"down {move.downtime:.1f} s" if move.downtime is not None else "not committed yet"
            moves.append(f"{job} {move.from_version} -> {move.to_version} {move.kind}, {down}")
    return Snapshot(found["status"], found["target_version"], found["members"], moves)


def render(key: str, now: Snapshot) -> Group:
    bar = Progress(TextColumn(f"to {now.target_version}"), BarColumn(bar_width=30), MofNCompleteColumn(),
                   TextColumn(f"members  {now.status}"))
    bar.add_task("members", total=max(len(now.members), 1), completed=now.done)
    members = Table("member", "phase", "status", "version", box=None, pad_edge=False)
    for m in now.members:
        members.add_row(m["name"], str(m["phase"]), m["status"], str(m["version"]))
    moves = Table("move", box=None, pad_edge=False)
    for move in now.moves:
        moves.add_row(move)
    return Group(f"upgrade {key}", bar, members, moves if now.moves else "no job has moved yet")


def follow(settings: Settings, key: str, interval: float = 2.0, until: Callable[[Snapshot], bool] | None = None,
           live: bool = True) -> Snapshot:
    """Redraw the upgrade's progress until it is no longer RUNNING (or `until` says so)."""
    finished = until or (lambda s: s.status != "RUNNING")
    now = snapshot(settings, key)
    with Live(render(key, now), refresh_per_second=2, auto_refresh=live) as shown:
        while not finished(now):
            time.sleep(interval)
            now = snapshot(settings, key)
            shown.update(render(key, now))
    return now


class ChangePrinter:
    """For a log that scrolls (the demo): each poll prints the members' phases and the moves that changed, after a
    text bar of the members done."""

    def __init__(self, settings: Settings, key: str, emit: Callable[[str], None]) -> None:
        self.settings, self.key, self.emit = settings, key, emit
        self.seen: set[str] = set()

    def __call__(self) -> None:
        try:
            now = snapshot(self.settings, self.key)
        except ChangeoverError:
            return  # the preflight has not recorded the upgrade yet
        except Exception as exc:  # noqa: BLE001 - a busy or restarting registry: this look is skipped, not the run
            log.warning("upgrade %s: progress not read this time (%s)", self.key, exc)
            return
        for line in now.lines():
            if line not in self.seen:
                self.seen.add(line)
                bar = "#" * now.done + "-" * (len(now.members) - now.done)
                self.emit(f"  [{bar}] {now.done}/{len(now.members)} {line}")
