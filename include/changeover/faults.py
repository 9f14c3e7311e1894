"""Named fault points for the tests of retries and crashes. Inert unless CHANGEOVER_FAULTS=1.

Two kinds, both reached only in a process whose environment enables them (a test's, or an Airflow the
test started with it):
- `point`: a test arms it by creating `<home>/faults/<point>`; the first process to reach it removes the
  file and raises, as a failed try would, or, armed with kill=True, SIGKILLs itself, as an OOM kill or a
  lost host would end a task, or, armed with hold=True, waits there until the test `release`s it (so the
  test can act, e.g. stop a database, at exactly that point), or, armed with delay=N, goes on N s later.
  Each firing is appended to `<home>/faults/fired.log`. A job's point may be armed for one Spark version.
- `crash`: CHANGEOVER_CRASH_AT=<point> kills the process there with SIGKILL, as `kill -9` would.
Outside tests neither looks at a file or a variable beyond the one switch.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from changeover.settings import Settings

SWITCH = "CHANGEOVER_FAULTS"


class InjectedFault(RuntimeError):
    pass


def enabled() -> bool:
    return os.environ.get(SWITCH) == "1"


HOLD_LIMIT_SECONDS = 600.0  # a held process whose test died goes on by itself


def env() -> dict[str, str]:
    """For a child process (a driver): the switch, passed on where it is set."""
    return {SWITCH: "1"} if enabled() else {}


def arm(settings: Settings, point: str, kill: bool = False, hold: bool = False, delay: float | None = None) -> Path:
    marker = settings.home / "faults" / point
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.with_name(f"{point}.release").unlink(missing_ok=True)
    written = marker.with_name(f".{point}.arming")
    written.write_text("kill" if kill else "hold" if hold else f"delay {delay}" if delay is not None else "raise")
    written.replace(marker)  # whole, or not there: a process reaching it never reads it half written
    return marker


def release(settings: Settings, point: str) -> None:
    """Let a process held at `point` go on."""
    (settings.home / "faults" / f"{point}.release").touch()


def fired(settings: Settings) -> list[str]:
    """The firings so far, one line each: `<point> <raise|kill|hold|delay N> pid <pid>[ <detail>]`, and a line
    `<point> hold expired pid <pid>` for a hold never released."""
    log = settings.home / "faults" / "fired.log"
    return log.read_text().splitlines() if log.exists() else []


def point(settings: Settings, name: str) -> None:
    if enabled():
        _reach(settings.home, name)


def reached_in_job(name: str, detail: str = "") -> None:
    """A point in a job's driver or executor, whose home its environment names (an executor's through
    `spark.executorEnv`); armed as `<name>` or `<name>.<its Spark version>`. `detail` goes into the firing's line."""
    home = os.environ.get("CHANGEOVER_HOME")
    if enabled() and home:
        import pyspark  # only a job's processes reach here, and they have their runtime's pyspark loaded

        _reach(Path(home), f"{name}.{pyspark.__version__}", detail)
        _reach(Path(home), name, detail)


def _reach(home: Path, name: str, detail: str = "") -> None:
    marker = home / "faults" / name
    taken = marker.with_name(f".{name}.{os.getpid()}.{threading.get_ident()}")
    try:
        marker.rename(taken)  # atomic: of the threads and processes that reach it, one fires it
    except FileNotFoundError:
        return  # not armed, or another one fired it first
    how = taken.read_text().strip() or "raise"
    taken.unlink()
    log = marker.parent / "fired.log"
    with open(log, "a") as lines:
        lines.write(f"{name} {how} pid {os.getpid()}{' ' + detail if detail else ''}\n")
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how.startswith("delay "):
        time.sleep(float(how.split()[1]))
        return
    if how == "hold":
        released, deadline = marker.with_name(f"{name}.release"), time.monotonic() + HOLD_LIMIT_SECONDS
        while not released.exists():
            if time.monotonic() > deadline:
                with open(log, "a") as lines:
                    lines.write(f"{name} hold expired pid {os.getpid()}\n")
                return
            time.sleep(0.2)
        return
    raise InjectedFault(f"fault injected at {name} (armed by {marker})")


def crash(name: str) -> None:
    if enabled() and os.environ.get("CHANGEOVER_CRASH_AT") == name:
        os.kill(os.getpid(), signal.SIGKILL)
