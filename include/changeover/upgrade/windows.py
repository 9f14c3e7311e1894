"""Weekly drain windows in UTC: when a drain may start, and for how long it may run.

Pure time arithmetic so the same rules serve the CLI, the operators and the Airflow timetable
(this module must not import Airflow).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta

from changeover.errors import ChangeoverError

DAY_NAMES: tuple[str, ...] = ("MON", "TUE", "WED", "THU", "FRI", "SAT", "SUN")
EXAMPLE = "SUN 02:00-04:00"

_TIMES = re.compile(r"^(\d{1,2}):(\d{2})-(\d{1,2}):(\d{2})$")
_ONE_DAY = timedelta(days=1)


def _clock(value: time) -> str:
    return f"{value.hour:02d}:{value.minute:02d}"


def _stamp(moment: datetime) -> str:
    return moment.strftime("%a %Y-%m-%d %H:%M UTC")


def require_utc(moment: datetime, what: str = "time") -> datetime:
    """The same instant in UTC; naive input is refused because guessing its zone could open a window hours off."""
    if moment.tzinfo is None or moment.utcoffset() is None:
        raise ChangeoverError(f"{what} {moment.isoformat()}", "it has no time zone, and drain windows are in UTC",
                              "pass an aware datetime, e.g. datetime.now(UTC) or datetime(..., tzinfo=UTC)")
    return moment.astimezone(UTC)


@dataclass(frozen=True)
class DrainWindow:
    """A window that opens every week on `days` at `start` UTC and closes at `end` UTC.

    `days` are the days the window opens (Monday=0 .. Sunday=6, as `datetime.weekday()`); when `end` is not
    after `start` the window crosses midnight and closes on the following day.
    """

    days: tuple[int, ...]
    start: time
    end: time

    def __post_init__(self) -> None:
        spec = f"{','.join(str(d) for d in self.days)} {self.start}-{self.end}"
        if not self.days:
            raise ChangeoverError(f"drain window {spec!r}", "it names no day", f"write it like {EXAMPLE!r}")
        if any(d not in range(7) for d in self.days) or list(self.days) != sorted(set(self.days)):
            raise ChangeoverError(f"drain window {spec!r}", "days must be distinct weekday numbers 0..6 in order",
                                  "build it with DrainWindow.parse, e.g. DrainWindow.parse('SAT,SUN 01:00-03:30')")
        for moment in (self.start, self.end):
            # Occurrences are computed in whole minutes of UTC; a zone or seconds would silently be ignored.
            if moment.tzinfo is not None or moment.second or moment.microsecond:
                raise ChangeoverError(f"drain window {spec!r}", f"{moment} is not a plain HH:MM time",
                                      "give start and end as time(hour, minute) without seconds or time zone")
        if self.start == self.end:
            raise ChangeoverError(f"drain window {self.spec!r}", "it closes at the moment it opens",
                                  "give an end time different from the start; a window lasts less than a day")

    @classmethod
    def parse(cls, spec: str) -> DrainWindow:
        """Reads 'SUN 02:00-04:00', 'SAT,SUN 01:00-03:30' or 'SUN 23:00-01:00' (ends Monday 01:00); UTC only."""
        refused = f"drain window {spec!r}"
        words = spec.split()
        if len(words) == 3:
            # Accept the form `summary` prints ('SUN 02:00-04:00 UTC'), so it can be pasted back.
            if words[2].upper() != "UTC":
                raise ChangeoverError(refused, f"time zone {words[2]!r} is not supported; drain windows are in UTC",
                                      f"convert the times to UTC and write it like {EXAMPLE!r}")
            words = words[:2]
        if len(words) != 2:
            raise ChangeoverError(refused, "it is not of the form DAYS HH:MM-HH:MM", f"write it like {EXAMPLE!r}")
        day_words, times = words
        days: list[int] = []
        for word in day_words.upper().split(","):
            if "-" in word:
                raise ChangeoverError(refused, f"day ranges like {word!r} are not supported",
                                      "list the days with commas, e.g. 'MON,TUE,WED 02:00-04:00'")
            if word not in DAY_NAMES:
                raise ChangeoverError(refused, f"unknown day {word!r} (days are {', '.join(DAY_NAMES)})",
                                      f"write it like {EXAMPLE!r}")
            day = DAY_NAMES.index(word)
            if day in days:
                raise ChangeoverError(refused, f"day {word} is listed twice", "name each day once")
            days.append(day)
        match = _TIMES.match(times)
        if match is None:
            raise ChangeoverError(refused, f"{times!r} is not a time range HH:MM-HH:MM", f"write it like {EXAMPLE!r}")
        start_h, start_m, end_h, end_m = (int(part) for part in match.groups())
        for hour, minute in ((start_h, start_m), (end_h, end_m)):
            if hour > 23 or minute > 59:
                raise ChangeoverError(refused, f"{hour:02d}:{minute:02d} is not a time of day (00:00..23:59)",
                                      "for a window that ends at midnight write the end as 00:00, "
                                      "e.g. 'SUN 22:00-00:00'")
        if (start_h, start_m) == (end_h, end_m):
            raise ChangeoverError(refused, "it closes at the moment it opens",
                                  "give an end time different from the start; a window lasts less than a day")
        return cls(tuple(sorted(days)), time(start_h, start_m), time(end_h, end_m))

    @property
    def spec(self) -> str:
        """The canonical text form, which `parse` reads back to an equal window."""
        return f"{','.join(DAY_NAMES[d] for d in self.days)} {_clock(self.start)}-{_clock(self.end)}"

    def __str__(self) -> str:
        return self.spec

    @property
    def duration(self) -> timedelta:
        today = date(2000, 1, 1)  # any date: UTC has no DST, so every occurrence lasts the same
        length = datetime.combine(today, self.end) - datetime.combine(today, self.start)
        return length if length > timedelta(0) else length + _ONE_DAY

    def _occurrence(self, day: date) -> tuple[datetime, datetime]:
        opens = datetime.combine(day, self.start, tzinfo=UTC)
        return opens, opens + self.duration

    def _occurrences(self, first_day: date, count: int, step: int = 1) -> list[tuple[datetime, datetime]]:
        days = (first_day + timedelta(days=i * step) for i in range(count))
        return [self._occurrence(day) for day in days if day.weekday() in self.days]

    def opening_at(self, now: datetime) -> tuple[datetime, datetime] | None:
        """(opens, closes) of the occurrence containing `now` (opens <= now < closes), or None outside."""
        now = require_utc(now, "now")
        # Occurrences last less than a day, so only one opening today or yesterday can still be open.
        for opens, closes in self._occurrences(now.date() - _ONE_DAY, 2):
            if opens <= now < closes:
                return opens, closes
        return None

    def next_opening(self, after: datetime, *, strict: bool = False) -> tuple[datetime, datetime]:
        """(opens, closes) of the first occurrence opening at or after `after` (strictly after when `strict`)."""
        after = require_utc(after, "after")
        # Eight days from today always reach the same weekday again, past today's opening.
        for opens, closes in self._occurrences(after.date(), 8):
            if opens > after or (opens == after and not strict):
                return opens, closes
        raise AssertionError("unreachable: a window opens at least once a week")

    def previous_opening(self, before: datetime) -> tuple[datetime, datetime]:
        """(opens, closes) of the latest occurrence opening at or before `before` (it may have closed already)."""
        before = require_utc(before, "before")
        for opens, closes in self._occurrences(before.date(), 8, step=-1):
            if opens <= before:
                return opens, closes
        raise AssertionError("unreachable: a window opens at least once a week")

    def seconds_left(self, now: datetime) -> float:
        """Seconds until the current occurrence closes; 0.0 outside the window."""
        occurrence = self.opening_at(now)
        return 0.0 if occurrence is None else (occurrence[1] - require_utc(now, "now")).total_seconds()


def may_start_drain(window: DrainWindow, now: datetime, needed_seconds: float) -> tuple[bool, str]:
    """Whether a drain needing `needed_seconds` can start at `now` and still finish before the window closes."""
    if needed_seconds < 0:
        raise ChangeoverError(f"drain time {needed_seconds} s", "it is negative",
                              "pass the seconds a drain needs, e.g. the shutdown timeout")
    now = require_utc(now, "now")
    name = f"the drain window {window.spec} UTC"
    occurrence = window.opening_at(now)
    if occurrence is None:
        opens, _ = window.next_opening(now)
        return False, f"outside {name} (now {_stamp(now)}; next opens {_stamp(opens)})"
    closes = occurrence[1]
    left = (closes - now).total_seconds()
    # Show the date of the close only when it differs from today's, e.g. a window past midnight.
    close_text = f"{_clock(closes.time())} UTC" if closes.date() == now.date() else _stamp(closes)
    if left < needed_seconds:
        reason = (f"only {int(left)} s of {name} remain (now {_stamp(now)}; closes {close_text}), "
                  f"and a drain needs {needed_seconds:g} s")
        if needed_seconds > window.duration.total_seconds():
            # No start time would ever do: say so, rather than let the operator wait for the next window.
            reason += (f"; the whole window lasts only {window.duration.total_seconds():.0f} s, "
                       "so widen the window or shorten the drain")
        return False, reason
    return True, f"inside {name} with {int(left)} s left (now {_stamp(now)}; closes {close_text})"
