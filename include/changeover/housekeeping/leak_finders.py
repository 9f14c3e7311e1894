"""What the leak checker sees (`observe`): each kind's finder, in the registry, on the masters and on disk, and the
sightings still open. The kinds are in `leaks`' docstring."""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from changeover import jobs, savepoints
from changeover.cluster import processes
from changeover.cluster.membership import Membership, NoMaster
from changeover.cluster.spark_master import MasterUnreachable, Workload
from changeover.errors import ChangeoverError
from changeover.handoff import lease
from changeover.light import ledger
from changeover.registry.db import session_scope
from changeover.registry.models import Event, JobRun, LightJob, Master, Member
from changeover.registry.states import LightState
from changeover.runtime.sinks import files
from changeover.settings import Settings
from changeover.timeutil import as_utc

FOUND, CLEANED, GONE = "leak.found", "leak.cleaned", "leak.gone"
ALIVE = ("SUBMITTED", "RUNNING", "RELAUNCHING")  # a driver in these states is its master's
MASTER_KINDS = ("run", "driver", "app")  # judged only on what a master answered
CONNECT_APP = "changeover-connect-"
JOB_APP = "changeover-"
STAGED = re.compile(r"^run(\d+)-batch\d+-")  # `files.Files.write`'s staging folder names its run
SUBJECT_CHARS = 200  # the length of `Event.subject`


@dataclass(frozen=True)
class Leak:
    kind: str
    subject: str  # names the thing, unique within its kind: the subject of its events
    why: str  # what makes it a leak, in words
    details: Mapping[str, Any] = field(default_factory=dict, compare=False)
    ours: bool = True  # False: nothing Changeover started runs it, so it is only reported
    quiet_until: datetime | None = None  # not cleaned before this either: until then its driver may still speak

    def __post_init__(self) -> None:
        if len(self.subject) > SUBJECT_CHARS:  # it must fit its events' column: its start, and a digest of the whole
            digest = hashlib.sha256(self.subject.encode()).hexdigest()[:12]
            object.__setattr__(self, "subject", f"{self.subject[:SUBJECT_CHARS - 13]}~{digest}")

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.subject


@dataclass(frozen=True)
class Observation:
    """What the leak checker saw: `decide` makes the plan of it."""
    leaks: tuple[Leak, ...] = ()
    first_seen: Mapping[tuple[str, str], datetime] = field(default_factory=dict)  # open sightings (`leak.found`)
    grace_seconds: float = 600.0
    unanswered: tuple[str, ...] = ()  # versions whose masters did not answer: nothing of theirs is judged now


def observe(settings: Settings, membership: Membership, grace_seconds: float) -> Observation:
    # Runs first, masters second: a run recorded with its submission before the look has its driver in the look, if
    # it lives. Masters first, registry second for drivers and apps: a driver in the look was recorded by then, or
    # is so new that the grace covers it (and it is looked at again before it is killed).
    live = _live_runs(settings)
    workloads, unanswered = _workloads(settings, membership)
    leaks = [*_ghost_runs(settings, membership, live, workloads),
             *_unaccounted(settings, membership, workloads),
             *_light_jobs(settings, membership),
             *_pidfiles(settings),
             *_savepoint_leftovers(settings),
             *_sink_stagings(settings)]
    return Observation(tuple(leaks), _open_sightings(settings), grace_seconds, tuple(unanswered))


def _live_runs(settings: Settings) -> list[JobRun]:
    """Runs the registry holds alive whose drivers were submitted: running, parked or standing by."""
    with session_scope(settings.database_url) as s:
        return list(s.scalars(select(JobRun).where(JobRun.ended_at.is_(None), JobRun.submission_id.is_not(None))
                              .order_by(JobRun.id)))


def _workloads(settings: Settings, membership: Membership) -> tuple[dict[str, Workload], list[str]]:
    """What each running master of the registry runs; a master that does not answer says nothing either way."""
    with session_scope(settings.database_url) as s:
        versions = list(s.scalars(select(Master.version).where(Master.status == "RUNNING").order_by(Master.version)))
    seen: dict[str, Workload] = {}
    unanswered = []
    for version in versions:
        try:
            seen[version] = membership.master(version).workload()
        except NoMaster:
            continue  # stopped meanwhile, its drivers with it: `jobs.observe` ends their runs
        except MasterUnreachable:
            unanswered.append(version)
    return seen, unanswered


def _ghost_runs(settings: Settings, membership: Membership, live: list[JobRun], workloads: dict[str, Workload]
                ) -> list[Leak]:
    found = []
    for run in live:
        workload = workloads.get(run.spark_version)
        if workload is None or any(d.submission_id == run.submission_id for d in workload.drivers):
            continue
        # The master's word first: a driver it lists as ended ends the run here, as any observation does.
        run = jobs.observe(settings, membership, run.id)
        if run.ended_at is not None:
            continue
        heard = as_utc(run.heartbeat_at or run.submitted_at)
        # Only the master's word ends a run, or a silence from both it and the driver (`jobs.observe`): not
        # before the loss deadline after the driver's last heartbeat.
        found.append(Leak("run", f"{run.job}/run-{run.id}",
                          f"the registry holds run {run.id} of job {run.job} {run.state}, and its master no longer "
                          f"reports its driver {run.submission_id}",
                          {"job": run.job, "run": run.id, "state": run.state, "master": run.spark_version,
                           "driver": run.submission_id, "heartbeat_at": heard.isoformat(timespec="seconds")},
                          quiet_until=heard + timedelta(seconds=lease.lost_after_seconds())))
    return found


def _unaccounted(settings: Settings, membership: Membership, workloads: dict[str, Workload]) -> list[Leak]:
    """Drivers and applications on the masters that nothing in the registry accounts for."""
    if not workloads:
        return []
    with session_scope(settings.database_url) as s:
        alive = list(s.execute(select(JobRun.spark_version, JobRun.submission_id, JobRun.job)
                               .where(JobRun.ended_at.is_(None))))
        members = {m.name: m.version for m in s.scalars(select(Member))}
        # A platform's masters run other teams' work too: there only what Changeover ever launched is judged.
        shared = membership.shared_masters
        ever = set(s.execute(select(JobRun.spark_version, JobRun.submission_id)
                             .where(JobRun.submission_id.is_not(None)))) if shared else set()
    drivers = {(version, submission) for version, submission, _ in alive if submission}
    jobs_alive = {job for _, _, job in alive}
    found = []
    for version, workload in workloads.items():
        servers = Counter(app.name for app in workload.apps if app.name.startswith(CONNECT_APP))
        for driver in workload.drivers:
            if shared and (version, driver.submission_id) not in ever:
                continue  # never one of ours: another team's driver on the platform's master
            if (version, driver.submission_id) not in drivers:
                found.append(Leak("driver", f"{version}/{driver.submission_id}",
                                  f"the Spark {version} master runs driver {driver.submission_id} ({driver.state}), "
                                  "and no run the registry holds alive has it",
                                  {"master": version, "driver": driver.submission_id, "state": driver.state,
                                   "worker": driver.worker}))
        for app in workload.apps:
            member = app.name.removeprefix(CONNECT_APP) if app.name.startswith(CONNECT_APP) else None
            if member is not None:
                at_version = members.get(member) == version
                if servers[app.name] > 1:  # one server a member: Spark does not say which one the registry's is
                    why = f"the Spark {version} master runs {servers[app.name]} applications named {app.name}"
                elif not at_version:
                    why = f"the Spark {version} master runs {app.name}, and member {member} is not at {version}"
                elif not membership.connect_running(member):
                    why = (f"the Spark {version} master runs {app.name}, and the registry records no Connect server "
                           f"of member {member} running")
                else:
                    continue
                # stopped by its member's PID file only when that can be no other server of the member
                found.append(Leak("app", f"{version}/{app.app_id}", why,
                                  {"master": version, "app": app.app_id, "name": app.name, "member": member},
                                  ours=at_version and servers[app.name] == 1))
            elif not shared and not (app.name.startswith(JOB_APP) and app.name.removeprefix(JOB_APP) in jobs_alive):
                # A job's application goes with its driver, a leak of its own if it is one; another's is nobody's
                # Changeover knows of, and is only reported.
                found.append(Leak("app", f"{version}/{app.app_id}",
                                  f"the Spark {version} master runs application {app.name!r}, which no live run's job "
                                  "and no Connect server accounts for",
                                  {"master": version, "app": app.app_id, "name": app.name}, ours=False))
    return found


def _light_jobs(settings: Settings, membership: Membership) -> list[Leak]:
    with session_scope(settings.database_url) as s:
        running = list(s.scalars(select(LightJob).where(LightJob.state == LightState.RUNNING).order_by(LightJob.id)))
    return [Leak("light_job", job.tag, why, {"tag": job.tag, "member": job.member, "version": job.spark_version,
                                             "server": job.server})
            for job, why in ledger.gone(settings, running, membership.connect_running) if why]


def _pid_dir(settings: Settings) -> Path:
    return settings.cluster_dir / "pids"


def _pidfiles(settings: Settings) -> list[Leak]:
    found = []
    for path in sorted(_pid_dir(settings).glob("*.pid")) if _pid_dir(settings).is_dir() else []:
        try:
            content = path.read_text(errors="replace")
        except FileNotFoundError:
            continue  # removed by its process's stop meanwhile
        if not _pid_running(content):
            found.append(Leak("pidfile", path.name, f"PID file {path.name} names no process group of ours that runs",
                              {"path": str(path), "content": content.strip()}))
    return found


def _pid_running(content: str) -> bool:
    """A PID file holds "pid start-ticks" (the loopback cluster's, `cluster.local`); while its group runs, the file
    is how it is ended."""
    parts = content.split()
    if len(parts) != 2 or not parts[0].isdigit():
        return False
    return processes.group_running(int(parts[0]), parts[1])


def _savepoint_leftovers(settings: Settings) -> list[Leak]:
    left = savepoints.reconcile(settings, dry_run=True)
    return [*(Leak("savepoint", name, f"savepoint {name} is PENDING and no builder holds it",
                   {"job": name.split("/", 1)[0], "name": name}) for name in left["rows"]),
            *(Leak("savepoint_folder", name,
                   f"savepoint folder {name} is " + ("a staging folder no builder holds" if "/.staging-" in name
                                                     else "named by no savepoint"),
                   {"job": name.split("/", 1)[0], "name": name, "path": str(settings.savepoint_dir / name)})
              for name in left["folders"])]


def _sink_stagings(settings: Settings) -> list[Leak]:
    """Staging folders of file sinks whose run has ended: a write cleans its own staging unless its driver died."""
    roots: dict[Path, str] = {}
    with session_scope(settings.database_url) as s:
        for job, described in s.execute(select(JobRun.job, JobRun.sinks)):
            for description in (described or {}).values():
                if isinstance(description, dict) and description.get("kind") == files.Files.kind:
                    try:
                        roots.setdefault(files.Files.from_description(description).root, job)
                    except ChangeoverError:
                        continue  # a path Changeover does not write to
    staged = [(job, folder, int(match[1])) for root, job in sorted(roots.items())
              if (root / files.STAGING).is_dir() for folder in sorted((root / files.STAGING).iterdir())
              if folder.is_dir() and (match := STAGED.match(folder.name))]
    if not staged:
        return []
    with session_scope(settings.database_url) as s:
        ended = {run.id: run.job for run in s.scalars(select(JobRun).where(
            JobRun.id.in_({run for _, _, run in staged}), JobRun.ended_at.is_not(None)))}
    # a run id this registry does not know, or a run of another job, is somebody else's: left alone
    return [Leak("sink_staging", f"{job}/{folder.name}",
                 f"file sink staging folder {folder} belongs to run {run}, which has ended",
                 {"job": job, "run": run, "path": str(folder)})
            for job, folder, run in staged if ended.get(run) == job]


def _open_sightings(settings: Settings) -> dict[tuple[str, str], datetime]:
    """Each leak found and neither cleaned nor gone since: when it was first seen (its last `leak.found`, since
    a leak is recorded found once between its closings)."""
    found: dict[tuple[str, str], datetime] = {}
    closed: dict[tuple[str, str], datetime] = {}
    with session_scope(settings.database_url) as s:
        for kind, subject, action, at in s.execute(
                select(Event.subject_kind, Event.subject, Event.action, func.max(Event.at))
                .where(Event.action.in_((FOUND, CLEANED, GONE)))
                .group_by(Event.subject_kind, Event.subject, Event.action)):
            key, at = (kind, subject), as_utc(at)
            if action == FOUND:
                found[key] = at
            else:
                closed[key] = max(at, closed.get(key, at))
    return {key: at for key, at in found.items() if key not in closed or at > closed[key]}
