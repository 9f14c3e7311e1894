"""Named fault points for the tests of retries and crashes. Inert unless CHANGEOVER_FAULTS=1.

Two kinds, both reached only in a process whose environment enables them (a test's, or an Airflow the
test started with it):
- `point`: a test arms it by creating `<home>/faults/<point>`; the first process to reach it removes the
  file and raises, as a failed try would, or, armed with kill=True, SIGKILLs itself, as an OOM kill or a
  lost host would end a task. Each firing is appended to `<home>/faults/fired.log`.
- `crash`: CHANGEOVER_CRASH_AT=<point> kills the process there with SIGKILL, as `kill -9` would.
Outside tests neither looks at a file or a variable beyond the one switch.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from changeover.settings import Settings

SWITCH = "CHANGEOVER_FAULTS"


class InjectedFault(RuntimeError):
    pass


def enabled() -> bool:
    return os.environ.get(SWITCH) == "1"


def arm(settings: Settings, point: str, kill: bool = False) -> Path:
    marker = settings.home / "faults" / point
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text("kill" if kill else "raise")
    return marker


def fired(settings: Settings) -> list[str]:
    """The firings so far, one line each: `<point> <raise|kill> pid <pid>`."""
    log = settings.home / "faults" / "fired.log"
    return log.read_text().splitlines() if log.exists() else []


def point(settings: Settings, name: str) -> None:
    if not enabled():
        return
    marker = settings.home / "faults" / name
    try:
        how = marker.read_text().strip() or "raise"
        marker.unlink()
    except FileNotFoundError:
        return  # not armed, or another process fired it first
    with open(marker.parent / "fired.log", "a") as log:
        log.write(f"{name} {how} pid {os.getpid()}\n")
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise InjectedFault(f"fault injected at {name} (armed by {marker})")


def crash(name: str) -> None:
    if enabled() and os.environ.get("CHANGEOVER_CRASH_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)
