"""Stopping a process group Changeover started, when the stopper is not the leader's parent (an Airflow task stops
a worker the CLI or the demo started): the dead leader stays a zombie until its parent reaps it."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from changeover.cluster import processes

PARENT = """import subprocess, sys, time
child = subprocess.Popen([sys.executable, sys.argv[1]], start_new_session=True)
print(child.pid, flush=True)
time.sleep(300)
"""
QUIET_LEADER = "import time; time.sleep(300)\n"
LEADER_WITH_STUBBORN_CHILD = """import pathlib, subprocess, sys, time
ready = pathlib.Path(sys.argv[0]).with_name("ignoring")
subprocess.Popen([sys.executable, "-c", "import pathlib, signal, sys, time; "
                  "signal.signal(signal.SIGTERM, signal.SIG_IGN); pathlib.Path(sys.argv[1]).touch(); time.sleep(300)",
                  str(ready)])
time.sleep(300)
"""


def _group(tmp_path: Path, leader: str) -> tuple[subprocess.Popen[str], int]:
    """A parent that starts a group (its leader runs `leader`) and never reaps it."""
    (tmp_path / "parent.py").write_text(PARENT)
    (tmp_path / "leader.py").write_text(leader)
    parent = subprocess.Popen([sys.executable, str(tmp_path / "parent.py"), str(tmp_path / "leader.py")],
                              stdout=subprocess.PIPE, text=True)
    return parent, int(parent.stdout.readline())  # type: ignore[union-attr]


def test_a_group_whose_leader_is_left_a_zombie_counts_as_stopped_at_once(tmp_path: Path) -> None:
    parent, leader = _group(tmp_path, QUIET_LEADER)
    try:
        began = time.monotonic()
        assert processes.stop_group(leader, processes.start_ticks(leader), timeout=60)
        # the SIGTERM ends it at once; what is left is a zombie its parent has not reaped, not a process to wait on
        assert time.monotonic() - began < 30, "stop_group waited out its timeout on a zombie"
        assert not processes.is_running(leader, processes.start_ticks(leader))
    finally:
        parent.kill()
        parent.wait()


def test_a_group_whose_leader_is_a_zombie_but_whose_child_runs_on_is_killed(tmp_path: Path) -> None:
    parent, leader = _group(tmp_path, LEADER_WITH_STUBBORN_CHILD)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "ignoring").exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # polled with a deadline: the child says once it ignores SIGTERM
        assert (tmp_path / "ignoring").exists(), "the leader's child did not start"
        child = next(pid for pid in processes.group_members(leader) if pid != leader)
        ticks = processes.start_ticks(child)

        assert processes.stop_group(leader, processes.start_ticks(leader), timeout=2)

        assert not processes.is_running(child, ticks), "the child that ignores SIGTERM runs on"
    finally:
        parent.kill()
        parent.wait()


def test_a_spawned_process_holds_none_of_its_starters_sockets(tmp_path: Path) -> None:
    """The fix of Airflow's deferral race (tests/e2e/dags/deferral_race.py reproduces it, under `make test-e2e`): a
    process that a task starts must not hold the task's stdin, a socket to the task's supervisor, or the task's exit
    is seen only when that process ends."""
    supervisor, task_end = socket.socketpair()
    saved_stdin = os.dup(0)
    os.dup2(task_end.fileno(), 0)  # as in an Airflow task
    try:
        started = processes.spawn([sys.executable, "-c", "import time; time.sleep(60)"], {"PATH": "/usr/bin:/bin"},
                                  tmp_path / "child.log")
    finally:
        os.dup2(saved_stdin, 0)
        os.close(saved_stdin)
        supervisor.close()
        task_end.close()
    try:
        held = []
        for fd in os.listdir(f"/proc/{started.pid}/fd"):
            with contextlib.suppress(FileNotFoundError):  # a file the starting interpreter closed meanwhile
                held.append(os.readlink(f"/proc/{started.pid}/fd/{fd}"))
        assert os.readlink(f"/proc/{started.pid}/fd/0") == "/dev/null", held
        assert not [h for h in held if h.startswith("socket:")], held
        assert os.getpgid(started.pid) == started.pid  # a group of its own, ended by its own PID file
    finally:
        processes.stop_group(started.pid, started.start_ticks, timeout=5)
