"""Named fault points for tests of retries: an armed point fails the step once, at that point.

A test arms a point by creating `<home>/faults/<point>`; the first process to reach the point removes
the file and raises. Nothing is armed in normal use, and a disarmed point costs one stat.
"""

from __future__ import annotations

from pathlib import Path

from changeover.settings import Settings


class InjectedFault(RuntimeError):
    pass


def arm(settings: Settings, point: str) -> Path:
    marker = settings.home / "faults" / point
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    return marker


def point(settings: Settings, name: str) -> None:
    marker = settings.home / "faults" / name
    try:
        marker.unlink()
    except FileNotFoundError:
        return
    raise InjectedFault(f"fault injected at {name} (armed by {marker})")
