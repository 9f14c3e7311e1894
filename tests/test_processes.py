"""Stopping a process group Changeover started, when the stopper is not the leader's parent (an Airflow task stops
a worker the CLI or the demo started): the dead leader stays a zombie until its parent reaps it."""

from __future__ import annotations

import subprocess
import sys
import time

from changeover import processes

PARENT = ("import subprocess, sys, time\n"
          "child = subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
          "print(child.pid, flush=True)\n"
          "time.sleep(300)\n")


def test_a_group_whose_leader_is_left_a_zombie_counts_as_stopped_at_once() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        leader = int(parent.stdout.readline())  # type: ignore[union-attr]
        began = time.monotonic()
        assert processes.stop_group(leader, processes.start_ticks(leader), timeout=60)
        # the SIGTERM ends it at once; what is left is a zombie its parent has not reaped, not a process to wait on
        assert time.monotonic() - began < 30, "stop_group waited out its timeout on a zombie"
        assert not processes.group_members(leader) or all(
            processes.cmdline(pid) == [] for pid in processes.group_members(leader))
    finally:
        parent.kill()
        parent.wait()
