"""`StandaloneCluster`: a Spark standalone cluster that Changeover did not start. Its masters (one per version group)
are the platform's and stay up; its members' workers are stopped and started at a version through the platform's
own command templates (`platform.PlatformSpec`), and observed through the masters' JSON, as on any cluster."""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

from sqlalchemy import select

from changeover import audit
from changeover.cluster import host_commands, rest_auth
from changeover.cluster.membership import MasterObservation, get_member, wait_for
from changeover.cluster.platform import PlatformSpec, load
from changeover.cluster.spark_master import SparkMaster
from changeover.errors import ChangeoverError
from changeover.registry.db import session_scope
from changeover.registry.models import JobRun, Master, Member
from changeover.settings import Settings

GONE = (None, "DEAD")  # the master's word for a worker whose process is no longer there
DAEMON_RUNS = "Stop it first"  # the end of spark-daemon.sh's refusal to start a daemon whose PID file's process runs
log = logging.getLogger(__name__)


class StandaloneCluster(MasterObservation):
    shared_masters = True  # the platform's masters run other teams' drivers too: the leak checker leaves those be

    def __init__(self, settings: Settings, spec: PlatformSpec | None = None, start_timeout: float = 120.0) -> None:
        if spec is None and settings.cluster_file is None:
            raise ChangeoverError("the standalone cluster", "no cluster file is configured",
                                  "set cluster_file in the changeover_default connection (or CHANGEOVER_CLUSTER_FILE)")
        self.settings = settings
        self.spec = spec or load(settings.cluster_file)  # type: ignore[arg-type]
        self.url = settings.database_url
        self.start_timeout = start_timeout

    @functools.cached_property
    def rest_key(self) -> str:
        """The platform's masters' key: it must be given, never made up here."""
        return rest_auth.load_key(self.settings.rest_key_file)

    # -- observation -------------------------------------------------------------------------
    def master(self, version: str) -> SparkMaster:
        spec = self.spec.master(version)
        return SparkMaster(spec.host, spec.webui_port, spec.rest_port, rest_key=self.rest_key)

    def status(self) -> dict[str, Any]:
        with session_scope(self.url) as s:
            members = [(m.name, m.version, m.status, m.host) for m in s.scalars(select(Member).order_by(Member.name))]
        return {
            "members": [{"name": name, "version": version, "status": status, "group": version, "host": host,
                         "running": self._worker_state(version, host) == "ALIVE", "connect": None}
                        for name, version, status, host in members],
            "masters": [{"version": m.version, "url": m.url, "webui": m.webui_url, "status": "PLATFORM",
                         "running": self._answers(m.version)} for m in self.spec.masters.values()],
        }

    def worker_running(self, member: str) -> bool:
        """Its worker process runs, as any of the file's masters sees it (decommissioned included)."""
        with session_scope(self.url) as s:
            host = get_member(s, member).host
        return any(self._worker_state(version, host) not in GONE for version in self.spec.masters)

    def check_reachable(self, member: str) -> None:
        """Runs the `check` template (e.g. `ssh {host} true`), when the file gives one: a refusal names the host."""
        with session_scope(self.url) as s:
            version = get_member(s, member).version
        self._run("check", member, version)

    def driver_python(self, version: str) -> str:
        return self.spec.python.format(version=version)

    # -- actions -----------------------------------------------------------------------------
    def up(self, specs: list[tuple[str, str]], master_port: int | None = None, light_jobs: bool = False) -> None:
        """Adopt the members as they run (a worker registered with a master of its version), starting through the
        template only those whose worker does not run."""
        if light_jobs:
            raise self._no_connect("up")
        for name, version in specs:
            self.spec.member(name)
            self.ensure_master(version)
        for name, version in specs:
            self.start_worker(name, version)

    def down(self) -> list[str]:
        raise ChangeoverError("cluster down", "Changeover did not start this standalone cluster: its masters and "
                              "workers are the platform's", "stop them with the platform's own service manager")

    def ensure_master(self, version: str, port: int | None = None) -> Master:
        """The platform's master of the group, checked against its own word on its version, and recorded."""
        spec = self.spec.master(version)
        served = self.master(version).server_version()
        if served != version:
            raise ChangeoverError(f"the master {spec.url}", f"the cluster file names it for Spark {version}, but it "
                                  f"serves Spark {served}", "correct the masters in the cluster file")
        with session_scope(self.url) as s:
            row = s.get(Master, version) or Master(version=version)
            fresh = row.status != "RUNNING"
            row.host, row.port = spec.host, int(spec.url.rsplit(":", 1)[1])
            row.webui_port, row.rest_port, row.pid, row.pid_started, row.status = (
                spec.webui_port, spec.rest_port, None, None, "RUNNING")
            s.add(row)
            if fresh:
                audit.record(s, "master.adopt", "master", version, url=spec.url)
            return row

    def stop_master_if_empty(self, version: str) -> bool:
        return False  # the platform's masters stay up, also with no worker

    def stop_empty_masters(self) -> list[str]:
        return []

    def start_worker(self, member: str, version: str, light_jobs: bool | None = None) -> None:
        """Start the member's worker at `version` through the template, and wait for it to register with that
        group's master. Safe to repeat: a worker already registered there is adopted."""
        if light_jobs:
            raise self._no_connect(f"start of member {member}")
        spec = self.spec.member(member)
        self.ensure_master(version)
        with session_scope(self.url) as s:
            row = s.get(Member, member)
            if row is None:
                row = Member(name=member, version=version, host=spec.host, webui_port=spec.webui_port,
                             status="STOPPED", light_jobs=False)
                s.add(row)
                audit.record(s, "member.add", "member", member, version=version, host=spec.host)
            current = row.version
        if current != version and self._worker_state(current, spec.host) in ("ALIVE", "DECOMMISSIONED"):
            raise ChangeoverError(f"start of member {member} at {version}", f"its worker still runs at {current}",
                                  f"upgrade it with `changeover upgrade member {member} --to {version}` after a drain")
        began, already_running = time.monotonic(), None
        if self._worker_state(version, spec.host) != "ALIVE":
            try:
                self._run("start_worker", member, version)
            except ChangeoverError as refused:
                # spark-daemon.sh refuses a second start of a daemon whose PID runs: a worker started moments ago,
                # not yet registered, is the one wanted, so it is waited for as one started here would be
                if DAEMON_RUNS not in str(refused):
                    raise
                already_running = refused.reason
                log.info("member %s's worker already runs, not yet registered: waiting for it (%s)", member,
                         already_running)
            fix = (f"look at the worker's log on host {spec.host}; the start command ran" if already_running is None
                   else f"the start was refused ({already_running}): a stale PID file, or a worker of another "
                        f"version, holds the daemon's slot on host {spec.host}; stop that process, then retry")
            wait_for(lambda: self._worker_state(version, spec.host) == "ALIVE", self.start_timeout,
                     f"member {member}'s worker registering with {self.spec.master(version).url}", fix=fix)
        with session_scope(self.url) as s:
            row = get_member(s, member)
            row.version, row.webui_port, row.status, row.drain_started_at = version, spec.webui_port, "ACTIVE", None
            audit.record(s, "member.start", "member", member, version=version, host=spec.host,
                         master=self.spec.master(version).url, seconds=round(time.monotonic() - began, 1),
                         adopted=already_running is not None)

    def stop_worker(self, member: str, grace: float = 20.0) -> None:
        """Stop the member's worker through the template and wait until its master no longer lists it alive."""
        with session_scope(self.url) as s:
            row = get_member(s, member)
            version, host = row.version, row.host
        foreign = self._foreign_drivers(version, host)
        if foreign:
            raise ChangeoverError(f"stop of member {member}'s worker", f"it runs drivers Changeover did not launch "
                                  f"({', '.join(foreign)}), which a restart would kill",
                                  "end or move them with the platform's own tooling (the drain decommissioned the "
                                  "worker: nothing new lands there), then retry the task")
        began = time.monotonic()
        # Run also when no master lists it: a retried stop, or a worker that registered late elsewhere. The
        # template must be safe to repeat (systemctl stop and spark-daemon.sh stop are).
        self._run("stop_worker", member, version)
        # a stopped worker's connection closes, and its master marks it DEAD at once
        wait_for(lambda: not self.worker_running(member), grace + self.spec.timeout_seconds,
                 f"member {member}'s worker leaving every master of the cluster file",
                 fix=f"look at host {host}: the stop command ran, but its worker still runs")
        with session_scope(self.url) as s:
            row = get_member(s, member)
            row.pid = None
            audit.record(s, "member.stop", "member", member, version=version, host=host,
                         seconds=round(time.monotonic() - began, 1))

    def decommission(self, member: str) -> None:
        """Through the `decommission` template where the file gives one, else through the master."""
        with session_scope(self.url) as s:
            row = get_member(s, member)
            version, host = row.version, row.host
        if self.spec.commands.get("decommission"):
            self._run("decommission", member, version)
        else:
            self.master(version).decommission(host)
        with session_scope(self.url) as s:
            audit.record(s, "member.decommission", "member", member, version=version)

    def remove_member(self, member: str) -> None:
        if self.worker_running(member):
            raise ChangeoverError(f"removal of member {member}", "its worker still runs",
                                  f"drain it and stop it first (`changeover drain {member}`)")
        with session_scope(self.url) as s:
            row = get_member(s, member)
            s.delete(row)
            audit.record(s, "member.remove", "member", member, version=row.version)

    # Light jobs need a Spark Connect server per member, which this backend does not run on the platform's hosts.
    def start_connect(self, member: str) -> str:
        raise self._no_connect(f"the Connect server of member {member}")

    def stop_connect(self, member: str, grace: float = 20.0) -> bool:
        return False

    def connect_running(self, member: str) -> bool:
        return False

    # -- helpers -----------------------------------------------------------------------------
    def _run(self, verb: str, member: str, version: str) -> None:
        command = self.spec.command(verb, member, version)
        if command is not None:
            host_commands.run(command, f"{verb} of member {member}", self.spec.member(member).host,
                              self.spec.timeout_seconds)

    def _foreign_drivers(self, version: str, host: str) -> list[str]:
        """Drivers on the host's worker that no run of Changeover's names: another team's, on the shared master."""
        state = self.master(version).state()
        workers = {w["id"] for w in state.get("workers", []) if w.get("host") == host and w.get("state") != "DEAD"}
        on_it = [str(d["id"]) for d in state.get("activedrivers", []) if d.get("worker") in workers]
        if not on_it:
            return []
        with session_scope(self.url) as s:
            ours = set(s.scalars(select(JobRun.submission_id).where(JobRun.submission_id.in_(on_it))))
        return [driver for driver in on_it if driver not in ours]

    def _worker_state(self, version: str, host: str) -> str | None:
        return self.master(version).worker_state(host)

    def _answers(self, version: str) -> bool:
        try:
            self.master(version).state()
        except ChangeoverError:
            return False
        return True

    @staticmethod
    def _no_connect(what: str) -> ChangeoverError:
        return ChangeoverError(what, "light jobs (a Spark Connect server per member) are not run on a standalone "
                               "cluster Changeover did not start", "run light jobs on a LocalCluster, or start "
                               "Connect servers with the platform's own tooling")
