"""The leak checker (issue 25): where the registry and Spark disagree, and what crashed work left behind.

A leak is one of these kinds:
- `run`: a run the registry holds alive (running, parked or a standby) whose driver its master no longer reports;
- `light_job`: a RUNNING light job whose member's Connect server is gone, and the job's session with it;
- `driver`: a driver on a Changeover master that no run the registry holds alive accounts for;
- `app`: an application on a master that neither a live run's job nor a running Connect server accounts for;
- `pidfile`: a PID file under the cluster folder whose process group is no longer ours and running;
- `savepoint`, `savepoint_folder`: what crashed savepoints left, as `savepoints.reconcile` finds it;
- `sink_staging`: a file sink's staging folder (`runtime.sinks.files.STAGING`) of a run that has ended.

A leak seen for less than the grace is only reported: what looks leaked may be work between two of its writes (a
launch between its submission and its record, a savepoint between its row and its folder). Its first sighting is
a `leak.found` event, so the grace holds across checks and processes; `leak.cleaned` records its cleanup, and
`leak.gone` one that stopped being a leak before (it ended by itself, or its owner recorded it meanwhile).

`observe` sees, `decide`, a pure function, makes the plan, and `act` carries it out, looking at each leak again
before it touches it; `check` is the one entry point. Nothing is ended that Changeover did not start: a driver
through its master's REST kill (as `jobs.cancel`), a Connect server by the process group Changeover started
(`Membership.stop_connect`), and an application with neither handle is only reported.
"""

from __future__ import annotations

import hashlib
import re
import shutil
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from changeover import audit, jobs, light, savepoints
from changeover.cluster import processes
from changeover.cluster.membership import Membership, NoMaster
from changeover.cluster.spark_master import MasterUnreachable, Workload
from changeover.errors import ChangeoverError
from changeover.handoff import lease
from changeover.light import ledger
from changeover.registry.db import session_scope
from changeover.registry.models import Event, JobRun, LightJob, Master, Member, utcnow
from changeover.registry.states import LightState, RunState
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
class Seen:
    """What the leak checker saw: `decide` makes the plan of it."""
    leaks: tuple[Leak, ...] = ()
    first_seen: Mapping[tuple[str, str], datetime] = field(default_factory=dict)  # open sightings (`leak.found`)
    grace_seconds: float = 600.0
    unanswered: tuple[str, ...] = ()  # versions whose masters did not answer: nothing of theirs is judged now


@dataclass
class LeakPlan:
    grace_seconds: float
    leaks: list[Leak] = field(default_factory=list)  # every leak seen now
    first_seen: dict[tuple[str, str], datetime] = field(default_factory=dict)
    new: set[tuple[str, str]] = field(default_factory=set)  # first seen now: recorded as found
    waiting: dict[tuple[str, str], float] = field(default_factory=dict)  # key -> seconds before it may be cleaned
    clean: list[Leak] = field(default_factory=list)  # past its grace: cleaned now
    reported: list[Leak] = field(default_factory=list)  # past its grace, but nothing of ours to end it by
    gone: list[tuple[str, str]] = field(default_factory=list)  # seen before, not now
    unanswered: tuple[str, ...] = ()


def decide(seen: Seen, now: datetime) -> LeakPlan:
    """Report every leak; clean one of ours once it has been seen for the grace (and, a run, once its driver has
    been silent for the loss deadline); close the sightings of leaks no longer seen, except those
    a master that did not answer might still hold."""
    plan = LeakPlan(seen.grace_seconds, list(seen.leaks), unanswered=seen.unanswered)
    for leak in seen.leaks:
        first = seen.first_seen.get(leak.key)
        if first is None:
            plan.new.add(leak.key)
        plan.first_seen[leak.key] = first = first or now
        ready = first + timedelta(seconds=seen.grace_seconds)
        if leak.quiet_until is not None:
            ready = max(ready, leak.quiet_until)
        if not leak.ours:
            plan.reported.append(leak)
        elif ready > now:
            plan.waiting[leak.key] = round((ready - now).total_seconds(), 1)
        else:
            plan.clean.append(leak)
    seen_now = {leak.key for leak in seen.leaks}
    plan.gone = sorted(key for key in seen.first_seen if key not in seen_now
                       and not (seen.unanswered and key[0] in MASTER_KINDS))
    return plan


@dataclass
class LeakReport:
    checked_at: datetime
    grace_seconds: float
    found: list[dict[str, Any]] = field(default_factory=list)  # every leak seen now, cleaned or not
    cleaned: list[dict[str, Any]] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)  # "kind subject" of leaks that ended by themselves
    refused: list[str] = field(default_factory=list)  # cleanups that could not be done: what, why, what to do
    unanswered: list[str] = field(default_factory=list)  # versions whose masters did not answer

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "checked_at": self.checked_at.isoformat(timespec="seconds")}


def check(settings: Settings, membership: Membership, grace_seconds: float, now: datetime | None = None
          ) -> LeakReport:
    """Find leaks, record the new ones, and clean those seen for grace_seconds or more. Safe to repeat, and to run
    beside the control plane: each leak is looked at again just before it is cleaned."""
    if grace_seconds < 0:
        raise ChangeoverError("leak check", f"the grace of {grace_seconds} s is negative",
                              "pass 0 (clean at once) or more seconds")
    now = as_utc(now) if now is not None else utcnow()
    return act(settings, membership, decide(observe(settings, membership, grace_seconds), now), now)


# -- observation ---------------------------------------------------------------------------------------------------

def observe(settings: Settings, membership: Membership, grace_seconds: float) -> Seen:
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
    return Seen(tuple(leaks), _open_sightings(settings), grace_seconds, tuple(unanswered))


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
    """A PID file holds "pid start-ticks" (`LocalCluster`); while its group runs, the file is how it is ended."""
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


# -- action --------------------------------------------------------------------------------------------------------

def act(settings: Settings, membership: Membership, plan: LeakPlan, now: datetime) -> LeakReport:
    """Record the new sightings and the leaks gone, then clean each leak due, one at a time: one that cannot be
    cleaned does not hold back the others, and is listed with its refusal."""
    with session_scope(settings.database_url) as s:
        for leak in plan.leaks:
            if leak.key in plan.new:
                _record(s, FOUND, leak.kind, leak.subject, now, why=leak.why, grace_seconds=plan.grace_seconds,
                        **leak.details)
        for kind, subject in plan.gone:
            _record(s, GONE, kind, subject, now, why="no longer seen: it ended by itself, or was accounted for")
    outcome: dict[tuple[str, str], str] = {}
    refused = []
    for leak in plan.clean:
        try:
            done = CLEANERS[leak.kind](settings, membership, leak, now)
        except ChangeoverError as exc:
            outcome[leak.key] = "refused"
            refused.append(f"{leak.kind} {leak.subject}: {exc}")
            continue
        outcome[leak.key] = "cleaned" if done else "gone"
        with session_scope(settings.database_url) as s:
            if done:
                _record(s, CLEANED, leak.kind, leak.subject, now, why=leak.why,
                        first_seen=plan.first_seen[leak.key].isoformat(timespec="seconds"), **leak.details)
            else:
                _record(s, GONE, leak.kind, leak.subject, now, why="no longer a leak when looked at again")
    found = [_described(plan, leak, now, outcome.get(leak.key) or ("waiting" if leak.key in plan.waiting
                                                                    else "reported")) for leak in plan.leaks]
    return LeakReport(now, plan.grace_seconds, found, [f for f in found if f["state"] == "cleaned"],
                      [f"{kind} {subject}" for kind, subject in plan.gone]
                      + [f"{f['kind']} {f['subject']}" for f in found if f["state"] == "gone"],
                      refused, list(plan.unanswered))


def _described(plan: LeakPlan, leak: Leak, now: datetime, state: str) -> dict[str, Any]:
    """state: cleaned | waiting (within its grace) | reported (not ours to end) | refused | gone (not a leak when
    looked at again)."""
    first = plan.first_seen[leak.key]
    return {"kind": leak.kind, "subject": leak.subject, "why": leak.why, "state": state, "new": leak.key in plan.new,
            "first_seen": first.isoformat(timespec="seconds"), "seen_for": round((now - first).total_seconds(), 1),
            "seconds_left": plan.waiting.get(leak.key), "details": dict(leak.details)}


def _record(s: Session, action: str, kind: str, subject: str, at: datetime, **details: Any) -> None:
    event = audit.record(s, action, kind, subject, **details)
    event.at = at  # the check's clock: the grace is measured on one clock, a test's `now` included


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
