"""`LocalCluster`: masters (one per version group) and workers (one per member) started on loopback from the
per-version runtimes, as processes of Changeover's own."""

from __future__ import annotations

import functools
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import select

from changeover import audit
from changeover.cluster import connect_server, processes, rest_auth
from changeover.cluster.membership import MasterObservation, NoMaster, get_member, wait_for
from changeover.cluster.ports import free_port, require_free
from changeover.cluster.runtimes import Runtime, find_runtime, java_home
from changeover.cluster.spark_master import SparkMaster
from changeover.errors import ChangeoverError
from changeover.names import check_name
from changeover.private_file import write_private
from changeover.registry.db import session_scope
from changeover.registry.models import Master, Member
from changeover.settings import Settings

WORKER_CORES = 4  # more than the machine has: drivers and executors of several jobs share workers
WORKER_MEMORY = "4g"
STOP_GRACE = 20.0  # seconds a worker with work on it gets to end its drivers and executors
IDLE_STOP_GRACE = 0.0  # a drained worker runs nothing of ours: no reason to wait on its shutdown hooks
# Masters and workers only place and launch work; C1 and the serial collector start them in about half the time
# on a busy machine (measured 4.3-5.6 s against 8.4-10.2 s beside three busy processes on 2 cores). The launcher
# JVM spark-class starts first gets the same. Drivers and executors get their options from their submission.
DAEMON_JAVA_OPTS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
WORKER_TIMEOUT = 30  # s without heartbeats before a master declares a worker lost (Spark's default: 60)


class LocalCluster(MasterObservation):
    shared_masters = False  # Changeover starts its masters, and stops one once its group is empty
    def __init__(self, settings: Settings, start_timeout: float = 60.0) -> None:
        self.settings = settings
        self.start_timeout = start_timeout  # for a master or worker to come up before it is stopped again
        self.url = settings.database_url
        self.pid_dir = settings.cluster_dir / "pids"

    @functools.cached_property
    def rest_key(self) -> str:
        """Read once per cluster object: every observation signs with it."""
        if self.settings.rest_key_configured:
            return rest_auth.load_key(self.settings.rest_key_file)
        return rest_auth.load_or_create_key(self.settings.rest_key_file)

    # -- observation -------------------------------------------------------------------------
    def master(self, version: str) -> SparkMaster:
        with session_scope(self.url) as s:
            row = _running_master(s, version)
            return SparkMaster(row.host, row.webui_port, row.rest_port, rest_key=self.rest_key)

    def status(self) -> dict[str, Any]:
        with session_scope(self.url) as s:
            members = s.scalars(select(Member).order_by(Member.name)).all()
            masters = s.scalars(select(Master).order_by(Master.version)).all()
            return {
                "members": [
                    {
                        "name": m.name,
                        "version": m.version,
                        "status": m.status,
                        "group": m.version,
                        "host": m.host,
                        "running": processes.is_running(m.pid, m.pid_started),
                        "connect": connect_server.address(m.host, m.connect_port)
                        if m.light_jobs and m.connect_port and processes.is_running(m.connect_pid,
                                                                                    m.connect_pid_started) else None,
                    }
                    for m in members
                ],
                "masters": [
                    {
                        "version": m.version,
                        "url": m.url,
                        "webui": f"http://{m.host}:{m.webui_port}",
                        "status": m.status,
                        "running": processes.is_running(m.pid, m.pid_started),
                    }
                    for m in masters
                ],
            }

    # -- actions -----------------------------------------------------------------------------
    def decommission(self, member: str) -> None:
        with session_scope(self.url) as s:
            row = get_member(s, member)
            version, host = row.version, row.host
        self.master(version).decommission(host)
        with session_scope(self.url) as s:
            audit.record(s, "member.decommission", "member", member, version=version)

    def up(self, specs: list[tuple[str, str]], master_port: int | None = None, light_jobs: bool = False) -> None:
        """Start masters and workers; with light_jobs, each member also runs a Spark Connect server."""
        java_home()
        for name, version in specs:
            check_name("member", name)
            find_runtime(self.settings.runtimes_dir, version)
        for name, version in specs:
            self.ensure_master(version, master_port)
            self.start_worker(name, version, light_jobs=light_jobs)

    def down(self) -> list[str]:
        """Stop every process this cluster folder records, also after a crash that lost the registry."""
        stopped = []
        for pidfile in sorted(self.pid_dir.glob("*.pid")) if self.pid_dir.exists() else []:
            pid, ticks = pidfile.read_text().split()
            if processes.stop_group(int(pid), ticks):
                stopped.append(pidfile.stem)
            pidfile.unlink(missing_ok=True)
        try:
            with session_scope(self.url) as s:
                for m in s.scalars(select(Member)):
                    m.connect_pid = m.connect_pid_started = None
                    if m.status != "STOPPED":
                        m.status, m.pid = "STOPPED", None
                        audit.record(s, "member.stop", "member", m.name, version=m.version)
                for master in s.scalars(select(Master)):
                    if master.status != "STOPPED":
                        master.status, master.pid = "STOPPED", None
                        audit.record(s, "master.stop", "master", master.version)
        except Exception as exc:  # noqa: BLE001 - the processes are what matter here
            if "no such table" not in str(exc):
                raise
        return stopped

    def ensure_master(self, version: str, port: int | None = None) -> Master:
        runtime = find_runtime(self.settings.runtimes_dir, version)
        with session_scope(self.url) as s:
            row = s.get(Master, version)
            if row and row.status == "RUNNING" and processes.is_running(row.pid, row.pid_started):
                return row
        port = require_free("127.0.0.1", port, f"the Spark {version} master") if port else free_port()
        webui, rest = free_port(), free_port()
        opts = (
            f"-Dspark.master.rest.enabled=true -Dspark.master.rest.port={rest} "
            "-Dspark.decommission.enabled=true -Dspark.deploy.spreadOut=true "
            f"-Dspark.worker.timeout={WORKER_TIMEOUT}"
        )
        # The REST server takes only signed requests; its key is in a file only we read, not on a command line.
        properties = write_private(self.settings.cluster_dir / "conf" / f"master-{version}.properties",
                                   rest_auth.master_properties(self.rest_key))
        started = processes.spawn(
            [str(runtime.spark_class), "org.apache.spark.deploy.master.Master",
             "--host", "127.0.0.1", "--port", str(port), "--webui-port", str(webui),
             "--properties-file", str(properties)],
            self._env(runtime, {"SPARK_MASTER_OPTS": opts}),
            self.settings.cluster_dir / "logs" / f"master-{version}.log",
        )
        master = SparkMaster("127.0.0.1", webui, rest, rest_key=self.rest_key)
        self._await_start(f"master-{version}", started,
                          lambda: master.state()["status"] == "ALIVE" and master.server_version() == version,
                          f"the Spark {version} master becoming ALIVE")
        with session_scope(self.url) as s:
            row = s.get(Master, version) or Master(version=version)
            row.host, row.port, row.webui_port, row.rest_port = "127.0.0.1", port, webui, rest
            row.pid, row.pid_started, row.status = started.pid, started.start_ticks, "RUNNING"
            s.add(row)
            audit.record(s, "master.start", "master", version, url=row.url, pid=started.pid)
            return row

    def stop_master_if_empty(self, version: str) -> bool:
        with session_scope(self.url) as s:
            users = s.scalars(select(Member).where(Member.version == version, Member.status != "STOPPED")).all()
            row = s.get(Master, version)
            if users or row is None or row.status != "RUNNING":
                return False
            processes.stop_group(row.pid, row.pid_started)
            (self.pid_dir / f"master-{version}.pid").unlink(missing_ok=True)
            row.status, row.pid = "STOPPED", None
            audit.record(s, "master.stop", "master", version, reason="its version group is empty")
            return True

    def stop_empty_masters(self) -> list[str]:
        """Stop every master whose group has no member left (one started for an upgrade that then upgraded none,
        or the old group's, when the task that emptied it died before it stopped it). Safe to repeat."""
        with session_scope(self.url) as s:
            versions = list(s.scalars(select(Master.version).where(Master.status == "RUNNING")))
        return [v for v in versions if self.stop_master_if_empty(v)]

    def start_worker(self, member: str, version: str, light_jobs: bool | None = None) -> None:
        """Start the member's worker at `version` (and its Connect server, if it serves light jobs: light_jobs
        sets that for a new member, None keeps what it had). Safe to repeat."""
        runtime = find_runtime(self.settings.runtimes_dir, version)
        master_row = self.ensure_master(version)
        master = SparkMaster(master_row.host, master_row.webui_port, master_row.rest_port, rest_key=self.rest_key)
        with session_scope(self.url) as s:
            row = s.get(Member, member)
            if row is None:
                row = Member(name=member, version=version, host=free_host(s), status="STOPPED",
                             light_jobs=bool(light_jobs))
                s.add(row)
                audit.record(s, "member.add", "member", member, version=version, host=row.host,
                             light_jobs=bool(light_jobs))
            elif light_jobs is not None:
                row.light_jobs = light_jobs
            alive = processes.is_running(row.pid, row.pid_started)
            serves = row.light_jobs
            running = alive and row.version == version and master.worker_state(row.host) == "ALIVE"
            if alive and not running:
                raise ChangeoverError(
                    f"start of member {member} at {version}",
                    f"its worker still runs at {row.version}",
                    f"upgrade it with `changeover upgrade member {member} --to {version}` after a drain",
                )
            host = row.host
        if running:  # a retried start: the worker is there; its Connect server may not be yet
            if serves:
                self.start_connect(member)
            return
        work = self.settings.cluster_dir / "members" / member
        webui, began = free_port(host), time.monotonic()
        started = processes.spawn(
            [str(runtime.spark_class), "org.apache.spark.deploy.worker.Worker", "--host", host,
             "--cores", str(WORKER_CORES), "--memory", WORKER_MEMORY, "--webui-port", str(webui),
             "--work-dir", str(work / f"work-{version}"), master_row.url],
            self._env(runtime, {
                "SPARK_LOCAL_IP": host,
                # the same timeout as its master's: a worker heartbeats every quarter of it
                "SPARK_WORKER_OPTS": f"-Dspark.decommission.enabled=true -Dspark.worker.timeout={WORKER_TIMEOUT}",
            }),
            self.settings.cluster_dir / "logs" / f"worker-{member}.log",
        )
        self._await_start(f"worker-{member}", started, lambda: master.worker_state(host) == "ALIVE",
                          f"member {member} registering with {master_row.url}")
        log = (self.settings.cluster_dir / "logs" / f"worker-{member}.log").read_text(errors="replace")
        if f"Running Spark version {version}" not in log.rsplit("Starting Spark worker", 1)[-1] and \
                f"Running Spark version {version}" not in log[-20000:]:
            raise ChangeoverError(f"member {member}", f"its worker does not report Spark {version}",
                                  "check the runtime folder of that version")
        with session_scope(self.url) as s:
            row = get_member(s, member)
            row.version, row.webui_port, row.status = version, webui, "ACTIVE"
            row.pid, row.pid_started, row.drain_started_at = started.pid, started.start_ticks, None
            audit.record(s, "member.start", "member", member, version=version, master=master_row.url,
                         pid=started.pid, seconds=round(time.monotonic() - began, 1))
            serves = row.light_jobs
        if serves:
            self.start_connect(member)

    def start_connect(self, member: str) -> str:
        """Start the member's Spark Connect server at its version, unless it runs. Returns its address."""
        with session_scope(self.url) as s:
            row = get_member(s, member)
            host, version, port = row.host, row.version, row.connect_port
            if processes.is_running(row.connect_pid, row.connect_pid_started) and port:
                return connect_server.address(host, port)
        runtime = find_runtime(self.settings.runtimes_dir, version)
        with session_scope(self.url) as s:
            master_url = _running_master(s, version).url
        # the same address across restarts, as a platform's would be: a client routed before an upgrade reaches the
        # upgraded server, whose version check then refuses it
        port = port if port and not _listening(host, port) and _bindable(host, port) else free_port(host)
        began = time.monotonic()
        work = self.settings.cluster_dir / "members" / member / f"connect-{version}"
        work.mkdir(parents=True, exist_ok=True)  # its warehouse and scratch files, not the caller's folder
        name = f"connect-{member}"
        started = processes.spawn(connect_server.command(runtime.spark_class, master_url, host, port, member),
                                  self._env(runtime, {"SPARK_LOCAL_IP": host}),
                                  self.settings.cluster_dir / "logs" / f"{name}.log", cwd=work)
        self._await_start(name, started, lambda: _listening(host, port),
                          f"the Spark Connect server of member {member} listening on {host}:{port}")
        with session_scope(self.url) as s:
            row = get_member(s, member)
            row.connect_port, row.connect_pid, row.connect_pid_started = port, started.pid, started.start_ticks
            audit.record(s, "member.connect.start", "member", member, version=version,
                         server=connect_server.address(host, port), pid=started.pid,
                         seconds=round(time.monotonic() - began, 1))
        return connect_server.address(host, port)

    def remove_member(self, member: str) -> None:
        """Forget a member whose worker is stopped (a surge member at the end of its upgrade)."""
        with session_scope(self.url) as s:
            row = get_member(s, member)
            if processes.is_running(row.pid, row.pid_started):
                raise ChangeoverError(f"removal of member {member}", "its worker still runs",
                                      f"drain it and stop it first (`changeover drain {member}`)")
            s.delete(row)
            audit.record(s, "member.remove", "member", member, version=row.version)

    def worker_running(self, member: str) -> bool:
        with session_scope(self.url) as s:
            row = get_member(s, member)
            return processes.is_running(row.pid, row.pid_started)

    def check_reachable(self, member: str) -> None:
        """Loopback members share this host: nothing to reach."""

    def driver_python(self, version: str) -> str:
        return str(find_runtime(self.settings.runtimes_dir, version).python)

    def connect_running(self, member: str) -> bool:
        with session_scope(self.url) as s:
            row = get_member(s, member)
            return processes.is_running(row.connect_pid, row.connect_pid_started)

    def stop_connect(self, member: str, grace: float = STOP_GRACE) -> bool:
        """Stop the member's Connect server (its light jobs with it). False if none ran. Safe to repeat."""
        with session_scope(self.url) as s:
            row = get_member(s, member)
            stopped = self._stop_recorded(f"connect-{member}", row.connect_pid, row.connect_pid_started, grace)
            if row.connect_pid is not None or stopped:
                row.connect_pid = row.connect_pid_started = None
                audit.record(s, "member.connect.stop", "member", member, version=row.version)
            return stopped

    def stop_worker(self, member: str, grace: float = STOP_GRACE) -> None:
        """SIGTERM the worker's process group, SIGKILL after `grace` s; pass IDLE_STOP_GRACE for a drained one.
        Its Connect server goes first: it would serve light jobs on a member that is going away."""
        self.stop_connect(member, grace)
        with session_scope(self.url) as s:
            row = get_member(s, member)
            began = time.monotonic()
            self._stop_recorded(f"worker-{member}", row.pid, row.pid_started, grace)
            row.pid = None
            audit.record(s, "member.stop", "member", member, version=row.version,
                         seconds=round(time.monotonic() - began, 1))

    # -- helpers -----------------------------------------------------------------------------
    def _stop_recorded(self, name: str, pid: int | None, ticks: str | None, grace: float) -> bool:
        """Stop the process group the registry records, and the one its PID file names (started by a try that
        died before the registry recorded it). True if either ran."""
        stopped = processes.stop_group(pid, ticks, timeout=grace)
        pidfile = self.pid_dir / f"{name}.pid"
        if pidfile.exists():
            file_pid, file_ticks = pidfile.read_text().split()
            stopped = processes.stop_group(int(file_pid), file_ticks, timeout=grace) or stopped
        pidfile.unlink(missing_ok=True)
        return stopped

    def _env(self, runtime: Runtime, extra: dict[str, str]) -> dict[str, str]:
        # Drivers inherit a worker's environment: no registry URL in it (they get a reference of their own).
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SPARK_", "PYSPARK_")) and k != "CHANGEOVER_DATABASE_URL"}
        env.update(
            SPARK_HOME=str(runtime.spark_home),
            SPARK_LOG_DIR=str(self.settings.cluster_dir / "logs"),
            SPARK_NO_DAEMONIZE="1",
            SPARK_DAEMON_JAVA_OPTS=DAEMON_JAVA_OPTS,
            SPARK_LAUNCHER_OPTS=DAEMON_JAVA_OPTS,
            **extra,
        )
        env.pop("JAVA_TOOL_OPTIONS", None)
        env.update(runtime.java_env(java_home()))  # drivers and executors inherit it from their worker's runtime
        return env

    def _write_pid(self, name: str, started: processes.Started) -> None:
        self.pid_dir.mkdir(parents=True, exist_ok=True)
        (self.pid_dir / f"{name}.pid").write_text(f"{started.pid} {started.start_ticks}\n")

    def _await_start(self, name: str, started: processes.Started, ready: Callable[[], bool], what: str) -> None:
        """Recorded before it is waited on, and stopped if the wait fails: a slow start leaves no orphan."""
        self._write_pid(name, started)
        try:
            wait_for(ready, self.start_timeout, what, fix=f"see {self.settings.cluster_dir / 'logs' / name}.log; the "
                                                "process was stopped, so the step can be retried")
        except BaseException:
            processes.stop_group(started.pid, started.start_ticks)
            (self.pid_dir / f"{name}.pid").unlink(missing_ok=True)
            raise


def _running_master(s: Any, version: str) -> Master:
    row = s.get(Master, version)
    if row is None or row.status != "RUNNING":
        raise NoMaster(f"version group {version}", "no master is running for it",
                       "start it with `changeover cluster up`")
    return row


def free_host(s: Any) -> str:
    """The lowest loopback address no member holds: removed members free theirs, and two members on one address
    would be one worker to the master (its decommission and state are by host)."""
    taken = set(s.scalars(select(Member.host)))
    return next(f"127.0.1.{i}" for i in range(1, 255) if f"127.0.1.{i}" not in taken)


def _listening(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
    except OSError:
        return False
    return True


def _bindable(host: str, port: int) -> bool:
    try:
        require_free(host, port, "a Connect server")
    except ChangeoverError:
        return False
    return True
