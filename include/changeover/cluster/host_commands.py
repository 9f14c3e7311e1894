"""A platform's command templates run on behalf of a member (stop its worker, start it at a version): each with a
timeout, its output in the log (an Airflow task's log, for a task), and a refusal that names the member and host."""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import threading
import time

from changeover.errors import ChangeoverError

log = logging.getLogger("changeover.cluster")
SSH_UNREACHABLE = 255  # ssh's own exit code: the connection failed, the command never ran
_running: dict[int, str] = {}  # process group -> command, of the commands this process runs now
_lock = threading.Lock()


def end_all() -> list[str]:
    """End every command this process runs now, whole process groups (ours: each started its own). For a task being
    killed: its retry must not run a second stop or start beside one left behind. Returns the commands ended."""
    with _lock:
        running = dict(_running)
    for group in running:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            continue
    return list(running.values())


def run(command: str, what: str, host: str, timeout: float) -> str:
    """Run `command` (no shell: split as a shell would), in a process group of its own that a timeout ends whole.
    Returns its output."""
    argv = shlex.split(command)
    log.info("%s: running %s", what, command)
    began = time.monotonic()
    try:
        child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 text=True, start_new_session=True)
    except OSError as exc:
        raise ChangeoverError(what, f"`{argv[0]}` could not be started: {exc.strerror}",
                              "fix the command template in the cluster file") from None
    with _lock:
        _running[child.pid] = command
    try:
        output, _ = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)  # ours: the group start_new_session made
        try:
            output, _ = child.communicate(timeout=5)
        except subprocess.TimeoutExpired:  # a grandchild that left the group still holds the pipe
            output = ""
        _log_output(what, output)
        raise ChangeoverError(what, f"`{command}` did not finish within {timeout:.0f} s (host {host} may not "
                              "answer)", f"check host {host}; raise commands.timeout_seconds if it is only slow, or "
                              "leave this member out of the upgrade's members") from None
    finally:
        with _lock:
            _running.pop(child.pid, None)
    _log_output(what, output)
    if child.returncode != 0:
        last = (output.strip().splitlines() or ["no output"])[-1]
        why = (f"host {host} did not answer over ssh ({last})" if child.returncode == SSH_UNREACHABLE
               and argv[0].endswith("ssh") else f"`{command}` exited {child.returncode}: {last}")
        raise ChangeoverError(what, why, f"make host {host} reachable and the command work, then retry the task; or "
                              "leave this member out of the upgrade's members")
    log.info("%s: done in %.1f s", what, time.monotonic() - began)
    return output


def _log_output(what: str, output: str) -> None:
    for line in output.splitlines():
        log.info("%s | %s", what, line)
