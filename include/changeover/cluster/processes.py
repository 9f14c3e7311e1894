"""Start and stop the processes Changeover owns, by process group, and only those."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

KILL_WAIT_SECONDS = 5.0  # after a SIGKILL, for the group to be gone


@dataclass(frozen=True)
class Started:
    pid: int
    start_ticks: str  # /proc start time, so a recycled PID is never mistaken for ours


def start_ticks(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def spawn(cmd: Sequence[str], env: Mapping[str, str], log_file: Path, cwd: Path | None = None) -> Started:
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as out:
        # stdin too: an Airflow task's stdin is its supervisor's socket, and a child holding it open keeps
        # the task's exit from being seen for a minute, long after a deferral, which races the trigger.
        proc = subprocess.Popen(
            list(cmd), env=dict(env), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
            start_new_session=True,
        )
    return Started(proc.pid, start_ticks(proc.pid) or "")


def is_ours(pid: int | None, ticks: str | None) -> bool:
    return bool(pid) and start_ticks(pid) == ticks  # type: ignore[arg-type]


def is_running(pid: int | None, ticks: str | None) -> bool:
    """Ours and not dead: a leader another of our processes started and has not reaped is ours, but a zombie."""
    return is_ours(pid, ticks) and not _is_zombie(pid)  # type: ignore[arg-type]


def group_running(pid: int | None, ticks: str | None) -> bool:
    """Some process of a group we started still runs, its leader a zombie or not: while one does, the leader's PID
    and start time (its PID file) are the handle `stop_group` ends the group by."""
    return is_ours(pid, ticks) and _group_alive(pid)  # type: ignore[arg-type]


def stop_group(pid: int | None, ticks: str | None, timeout: float = 20.0) -> bool:
    """SIGTERM the process group we started, then SIGKILL what is left after a deadline. False if it was gone."""
    if not is_ours(pid, ticks):
        return False
    assert pid is not None
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    # The group outlives its leader while children (drivers, executors) shut down: wait for all of it.
    _wait_gone(pid, timeout, interval=0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)  # nothing should be left; if anything is, it goes
    _wait_gone(pid, KILL_WAIT_SECONDS, interval=0.05)  # so what starts next in its place never races it
    return True


def _wait_gone(pgid: int, seconds: float, interval: float) -> bool:
    """Reap the leader if it is our child, and wait until no process of the group runs (zombies aside)."""
    deadline = time.monotonic() + seconds
    while True:
        _reap(pgid)
        if not _group_alive(pgid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def group_members(pgid: int) -> list[int]:
    """PIDs in a process group we started."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    found.append(int(entry.name))
            except ProcessLookupError:
                continue
    return found


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def _group_alive(pgid: int) -> bool:
    """Some process of the group still runs. A zombie does not: one whose parent is another of our processes (the
    CLI or demo that started the cluster, while an Airflow task stops it) stays a zombie until that parent ends."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return any(not _is_zombie(pid) for pid in group_members(pgid))


def _is_zombie(pid: int) -> bool:
    """Dead and not reaped: state Z with no thread left (a process whose main thread exited shows Z while its
    other threads still run)."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if ":" in line)
    except OSError:
        return True
    return fields.get("State", "").strip().startswith("Z") and fields.get("Threads", "1").strip() == "1"


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
