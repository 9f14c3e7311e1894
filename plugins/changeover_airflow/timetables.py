"""An Airflow timetable that starts a run when a weekly drain window opens; the run's data interval is the window."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pendulum
from airflow.timetables.base import DagRunInfo, DataInterval, TimeRestriction, Timetable
from changeover.upgrade.windows import DAY_NAMES, DrainWindow
from pendulum import DateTime


def _utcnow() -> datetime:
    """The scheduler's clock; a function of its own so tests can replace it with a fixed time."""
    return datetime.now(UTC)


def _pendulum(moment: datetime) -> DateTime:
    # Airflow expects pendulum DateTimes in data intervals; the core window logic speaks plain datetime.
    return pendulum.instance(moment).in_timezone("UTC")


class DrainWindowTimetable(Timetable):
    """Schedule a run at each opening of a weekly UTC drain window, e.g. ``DrainWindowTimetable("SUN 02:00-04:00")``.

    Each run's data interval is the window occurrence (opens, closes), so tasks can read how long the drain may
    take from ``data_interval_end``. Conventions follow Airflow's ``CronTriggerTimetable``, with one deliberate
    difference: with ``catchup=False`` a missed opening whose window has already closed is skipped, because a drain
    started after its window closed would run outside it.
    """

    def __init__(self, window: str | DrainWindow) -> None:
        self.window = window if isinstance(window, DrainWindow) else DrainWindow.parse(window)
        days = ", ".join(DAY_NAMES[d].title() for d in self.window.days)
        minutes = self.window.duration.total_seconds() / 60
        self.description = (f"When the drain window opens: {days} at {self.window.start:%H:%M} UTC, "
                            f"for {minutes:.0f} min")

    def __eq__(self, other: object) -> bool:
        # DAG serialization compares timetables to detect changes; equal windows mean the same schedule.
        return isinstance(other, DrainWindowTimetable) and self.window == other.window

    def __hash__(self) -> int:
        return hash(self.window)

    def __repr__(self) -> str:
        return f"DrainWindowTimetable({self.window.spec!r})"

    @classmethod
    def deserialize(cls, data: dict[str, Any]) -> Timetable:
        return cls(data["window"])

    def serialize(self) -> dict[str, Any]:
        return {"window": self.window.spec}

    @property
    def summary(self) -> str:
        return f"drain window {self.window.spec} UTC"

    def infer_manual_data_interval(self, *, run_after: DateTime) -> DataInterval:
        """A manual run inside a window gets that window; outside, it gets no window (an empty interval)."""
        occurrence = self.window.opening_at(run_after)
        if occurrence is None:
            # An empty interval ending now tells tasks no drain time is left, rather than lending a far window.
            return DataInterval.exact(_pendulum(run_after))
        return DataInterval(_pendulum(occurrence[0]), _pendulum(occurrence[1]))

    def _open_now_or_next(self, now: datetime) -> datetime:
        """The opening of the window open at `now`, or else the next opening."""
        occurrence = self.window.opening_at(now)
        return occurrence[0] if occurrence is not None else self.window.next_opening(now)[0]

    def next_dagrun_info(
        self,
        *,
        last_automated_data_interval: DataInterval | None,
        restriction: TimeRestriction,
    ) -> DagRunInfo | None:
        # Same shape as CronTriggerTimetable.next_dagrun_info; `_open_now_or_next` stands in for "latest tick <= now".
        after_last = None
        if last_automated_data_interval is not None:
            # Occurrences never overlap, so the next one opens after the last one closed.
            after_last = self.window.next_opening(last_automated_data_interval.end)[0]
        if restriction.catchup:
            if after_last is not None:
                opens = after_last
            elif restriction.earliest is None:
                opens = self._open_now_or_next(_utcnow())
            else:
                opens = self.window.next_opening(restriction.earliest)[0]
        else:
            candidates = [self._open_now_or_next(_utcnow())]
            if after_last is not None:
                candidates.append(after_last)
            if restriction.earliest is not None:
                candidates.append(self.window.next_opening(restriction.earliest)[0])
            opens = max(candidates)
        if restriction.latest is not None and restriction.latest < opens:
            return None
        # Run at the opening (not at the close, as DagRunInfo.interval would): the drain must happen inside.
        start = _pendulum(opens)
        return DagRunInfo(run_after=start, data_interval=DataInterval(start, _pendulum(opens + self.window.duration)))
