"""How the leak checker cleans each kind of leak (`CLEANERS`): each cleaner looks at its leak again first, and says
whether it cleaned it (False: no longer a leak)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import select

from changeover import jobs, light, savepoints
from changeover.cluster.membership import Membership
from changeover.errors import ChangeoverError
from changeover.handoff import lease
from changeover.housekeeping.leak_finders import ALIVE, Leak, _pid_running
from changeover.light import ledger
from changeover.registry.db import session_scope
from changeover.registry.models import JobRun
from changeover.registry.states import LightState, RunState
from changeover.settings import Settings
from changeover.timeutil import as_utc

Cleaner = Callable[[Settings, Membership, Leak, datetime], bool]


def _end_run(settings: Settings, membership: Membership, leak: Leak, now: datetime) -> bool:
    """End a run whose driver its master no longer reports, as a kill would (`jobs.end_for_restart`: a parked run
    ends STOPPED on its boundary, and the job stays wanted), or dismiss it, a standby."""
    run = jobs.observe(settings, membership, int(leak.details["run"]))
    if run.ended_at is not None or run.submission_id is None:
        return False
    heard = as_utc(run.heartbeat_at or run.submitted_at)
    if heard + timedelta(seconds=lease.lost_after_seconds()) > now:
        return False  # its driver spoke since: it lives, wherever its master lost it
    if membership.master(run.spark_version).status(run.submission_id).state in ALIVE:
        return False  # its master reports it again
    reason = (f"ended by the leak checker: its master no longer reports its driver {run.submission_id}, and the "
              f"driver has not been heard of since {heard.isoformat(timespec='seconds')}")
    if run.state == RunState.STANDBY:
        return jobs.dismiss_standby(settings, membership, run.id, reason)
    jobs.end_for_restart(settings, membership, run.id, reason)
    return True


def _kill_driver(settings: Settings, membership: Membership, leak: Leak, now: datetime) -> bool:
    """Kill a driver nothing accounts for through its master's REST server, as `jobs.cancel` does."""
    version, submission = str(leak.details["master"]), str(leak.details["driver"])
    with session_scope(settings.database_url) as s:
        if s.scalar(select(JobRun.id).where(JobRun.spark_version == version, JobRun.submission_id == submission,
                                            JobRun.ended_at.is_(None))) is not None:
            return False  # recorded meanwhile, by its launch or by its driver itself
    master = membership.master(version)
    if master.status(submission).state not in ALIVE:
        return False
    jobs.kill_driver(master, submission, f"driver {submission} on the Spark {version} master, which no run accounts "
                     "for")
    return True


def _stop_connect_server(settings: Settings, membership: Membership, leak: Leak, now: datetime) -> bool:
    """Stop a member's Connect server the registry does not record as running: by the process group Changeover
    started it as (`Membership.stop_connect`, which also reads its PID file), never by its name."""
    version, member, app = str(leak.details["master"]), str(leak.details["member"]), str(leak.details["app"])
    if membership.connect_running(member):
        return False  # recorded meanwhile
    if all(running.app_id != app for running in membership.master(version).workload().apps):
        return False
    if not membership.stop_connect(member):
        raise ChangeoverError(
            f"end of application {leak.details['name']} ({app}) on the Spark {version} master",
            f"no process Changeover started runs it: neither the registry nor a PID file names a Connect server of "
            f"member {member}", "end it from the master's web UI if nobody uses it; each check reports it until then")
    return True


def _end_light_job(settings: Settings, membership: Membership, leak: Leak, now: datetime) -> bool:
    """End the row of a light job whose server or client is gone: there is nothing left to interrupt."""
    job = ledger.get(settings, str(leak.details["tag"]))
    if job.state != LightState.RUNNING:
        return False
    [(_, why)] = ledger.gone(settings, [job], membership.connect_running)
    if why is None:
        return False
    light.interrupt(settings, job.tag, f"the leak checker: {why}", settle=0)  # a silent client's query may run on
    return ledger.get(settings, job.tag).state == LightState.INTERRUPTED


def _remove_pidfile(settings: Settings, membership: Membership, leak: Leak, now: datetime) -> bool:
    path = Path(str(leak.details["path"]))
    try:
        content = path.read_text(errors="replace")
    except FileNotFoundError:
        return False
    if content.strip() != leak.details["content"] or _pid_running(content):
        return False  # written again by a new start
    path.unlink(missing_ok=True)
    return True


def _reconcile_savepoint(settings: Settings, membership: Membership, leak: Leak, now: datetime) -> bool:
    name = str(leak.details["name"])
    return name in savepoints.reconcile(settings, only={name})["rows" if leak.kind == "savepoint" else "folders"]


def _remove_sink_staging(settings: Settings, membership: Membership, leak: Leak, now: datetime) -> bool:
    folder = Path(str(leak.details["path"]))
    with session_scope(settings.database_url) as s:
        run = s.get(JobRun, int(leak.details["run"]))
        if run is None or run.ended_at is None or not folder.is_dir():
            return False
    shutil.rmtree(folder, ignore_errors=True)
    return True


CLEANERS: dict[str, Cleaner] = {
    "run": _end_run,
    "driver": _kill_driver,
    "app": _stop_connect_server,  # only a member's Connect server is ours: other applications are only reported
    "light_job": _end_light_job,
    "pidfile": _remove_pidfile,
    "savepoint": _reconcile_savepoint,
    "savepoint_folder": _reconcile_savepoint,
    "sink_staging": _remove_sink_staging,
}
