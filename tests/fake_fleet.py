"""A test double of `changeover.cluster.Membership`: masters and workers that live in memory, over the real registry.

The control plane (drain, roll, relocate, placement, recovery) runs unchanged against it, so its decisions are
tested in seconds, without Spark: a submission becomes a driver on the first alive worker of its version group,
a stopped worker loses its drivers as Spark's master reports them (ERROR), and every call is counted. Drivers do
not run: a test plays their part in the registry (heartbeats, commits, parking) with the runtime's own functions.
The benchmarks use it too (bench/fleet_scale.py).
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from changeover import audit
from changeover.cluster import NoMaster, get_member
from changeover.cluster.local import free_host
from changeover.cluster.spark_master import ActiveApp, ActiveDriver, DriverStatus, MasterUnreachable, Workload
from changeover.registry.db import session_scope
from changeover.registry.models import Master, Member
from changeover.settings import Settings
from sqlalchemy import select

_submissions = itertools.count(1)


@dataclass
class FakeDriver:
    state: str  # Spark's words: SUBMITTED, RUNNING, FINISHED, FAILED, KILLED, ERROR
    host: str | None
    request: dict[str, Any]


@dataclass
class FakeMaster:
    """One version group's master: its workers' states by host and its drivers by submission id."""

    version: str
    workers: dict[str, str] = field(default_factory=dict)  # host -> ALIVE | DECOMMISSIONED | DEAD
    drivers: dict[str, FakeDriver] = field(default_factory=dict)
    apps: dict[str, str] = field(default_factory=dict)  # app id -> name: apps other than its drivers' (Connect's)
    calls: Counter[str] = field(default_factory=Counter)
    unanswered: set[str] = field(default_factory=set)  # verbs that time out, as a master slow to answer them

    def _call(self, verb: str) -> None:
        self.calls[verb] += 1
        if verb in self.unanswered:
            raise MasterUnreachable(f"the fake {self.version} master", "it did not answer in time",
                                    "nothing: the test made it so")

    def state(self) -> dict[str, Any]:
        self._call("state")
        return {"url": f"spark://fake-{self.version}:7077", "status": "ALIVE",
                "workers": [{"host": h, "state": s, "lastheartbeat": 0} for h, s in self.workers.items()]}

    def alive_workers(self) -> list[dict[str, Any]]:
        return [w for w in self.state()["workers"] if w["state"] == "ALIVE"]

    def worker_state(self, host: str) -> str | None:
        self._call("worker_state")
        return self.workers.get(host)

    def workload(self) -> Workload:
        self._call("workload")
        live = {sid: d for sid, d in self.drivers.items() if d.state in ("SUBMITTED", "RUNNING")}
        # a running driver in cluster mode registers its application, under the submission's spark.app.name
        apps = [ActiveApp(f"app-{sid}", d.request.get("sparkProperties", {}).get("spark.app.name", ""), "RUNNING")
                for sid, d in live.items() if d.state == "RUNNING"]
        return Workload(tuple(ActiveDriver(sid, d.state, f"worker-{d.host}" if d.host else None)
                              for sid, d in live.items()),
                        tuple(apps + [ActiveApp(app, name, "RUNNING") for app, name in self.apps.items()]))

    def server_version(self) -> str:
        self._call("server_version")
        return self.version

    def create(self, request: dict[str, Any]) -> str:
        self._call("create")
        host = next((h for h, s in self.workers.items() if s == "ALIVE"), None)
        submission = f"driver-fake-{next(_submissions):05d}"
        self.drivers[submission] = FakeDriver("RUNNING" if host else "SUBMITTED", host, request)
        return submission

    def status(self, submission_id: str) -> DriverStatus:
        self._call("status")
        driver = self.drivers.get(submission_id)
        return DriverStatus(submission_id, driver.state if driver else "UNKNOWN", driver.host if driver else None,
                            self.version)

    def kill(self, submission_id: str) -> bool:
        self._call("kill")
        driver = self.drivers.get(submission_id)
        if driver is None or driver.state not in ("SUBMITTED", "RUNNING"):
            return False
        driver.state = "KILLED"
        return True

    def decommission(self, host: str) -> None:
        self._call("decommission")
        if host in self.workers:
            self.workers[host] = "DECOMMISSIONED"


class FakeFleet:
    shared_masters = False
    """Members and masters in the registry, their processes in memory."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.masters: dict[str, FakeMaster] = {}
        self.executors: dict[str, int] = {}  # member -> executors left on its worker
        self.connect_servers: dict[str, str] = {}  # member -> the version its Connect server runs

    # -- observation ----------------------------------------------------------------------------------
    def master(self, version: str) -> FakeMaster:  # type: ignore[override]
        if version not in self.masters:
            raise NoMaster(f"version group {version}", "no master is running for it", "start one")
        return self.masters[version]

    def status(self) -> dict[str, Any]:
        with session_scope(self.settings.database_url) as s:
            members = s.scalars(select(Member).order_by(Member.name)).all()
            return {"members": [{"name": m.name, "version": m.version, "status": m.status, "group": m.version,
                                 "host": m.host, "running": self._worker(m) == "ALIVE",
                                 "connect": f"sc://{m.host}:1" if m.name in self.connect_servers else None}
                                for m in members],
                    "masters": [{"version": v, "url": f"spark://fake-{v}:7077", "status": "RUNNING",
                                 "running": True} for v in sorted(self.masters)]}

    def executors_on(self, member: str) -> int:
        return self.executors.get(member, 0)

    def is_decommissioned(self, member: str) -> bool:
        with session_scope(self.settings.database_url) as s:
            row = get_member(s, member)
            version, host = row.version, row.host
        master = self.masters.get(version)
        return master is None or master.worker_state(host) in (None, "DECOMMISSIONED", "DEAD")

    # -- actions ----------------------------------------------------------------------------------------
    def up(self, specs: list[tuple[str, str]], master_port: int | None = None, light_jobs: bool = False) -> None:
        for name, version in specs:
            self.start_worker(name, version, light_jobs=light_jobs)

    def down(self) -> list[str]:
        stopped = []
        with session_scope(self.settings.database_url) as s:
            for row in s.scalars(select(Member)):
                if row.status != "STOPPED":
                    row.status = "STOPPED"
                    stopped.append(f"worker-{row.name}")
            for master in s.scalars(select(Master)):
                master.status = "STOPPED"
        self.masters.clear()
        return stopped

    def ensure_master(self, version: str, port: int | None = None) -> Master:
        self.masters.setdefault(version, FakeMaster(version))
        with session_scope(self.settings.database_url) as s:
            row = s.get(Master, version) or Master(version=version, host="127.0.0.1", port=7077, webui_port=8080,
                                                   rest_port=6066)
            if row.status != "RUNNING":
                row.status = "RUNNING"
                s.add(row)
                audit.record(s, "master.start", "master", version, url=f"spark://fake-{version}:7077")
            return row

    def stop_master_if_empty(self, version: str) -> bool:
        with session_scope(self.settings.database_url) as s:
            users = s.scalars(select(Member).where(Member.version == version, Member.status != "STOPPED")).all()
            row = s.get(Master, version)
            if users or row is None or row.status != "RUNNING":
                return False
            row.status = "STOPPED"
            audit.record(s, "master.stop", "master", version, reason="its version group is empty")
        self.masters.pop(version, None)
        return True

    def stop_empty_masters(self) -> list[str]:
        return [v for v in sorted(self.masters) if self.stop_master_if_empty(v)]

    def start_worker(self, member: str, version: str, light_jobs: bool | None = None) -> None:
        self.ensure_master(version)
        with session_scope(self.settings.database_url) as s:
            row = s.get(Member, member)
            if row is None:
                row = Member(name=member, version=version, host=free_host(s), status="STOPPED")
                s.add(row)
            if light_jobs is not None:
                row.light_jobs = light_jobs
            row.version, row.status, row.drain_started_at = version, "ACTIVE", None
            host, serves = row.host, row.light_jobs
            audit.record(s, "member.start", "member", member, version=version)
        for master in self.masters.values():
            master.workers.pop(host, None)
        self.masters[version].workers[host] = "ALIVE"
        if serves:
            self.start_connect(member)

    # A member's Connect server, as the registry records it; nothing listens at its address (a fake).
    def start_connect(self, member: str) -> str:
        with session_scope(self.settings.database_url) as s:
            row = get_member(s, member)
            row.connect_port, row.connect_pid, row.connect_pid_started = 1, 1, "fake"
            self.connect_servers[member] = row.version
            if row.version in self.masters:  # a Connect server is an application of its version group's master
                self.masters[row.version].apps[f"app-connect-{member}"] = f"changeover-connect-{member}"
            return f"sc://{row.host}:1"

    def stop_connect(self, member: str, grace: float = 0.0) -> bool:
        with session_scope(self.settings.database_url) as s:
            row = get_member(s, member)
            row.connect_pid = row.connect_pid_started = None
        version = self.connect_servers.pop(member, None)
        if version in self.masters:
            self.masters[version].apps.pop(f"app-connect-{member}", None)
        return version is not None

    def remove_member(self, member: str) -> None:
        with session_scope(self.settings.database_url) as s:
            row = get_member(s, member)
            assert self._worker(row) != "ALIVE", f"member {member}'s worker still runs"
            s.delete(row)
            audit.record(s, "member.remove", "member", member, version=row.version)

    def connect_running(self, member: str) -> bool:
        return member in self.connect_servers

    def worker_running(self, member: str) -> bool:
        with session_scope(self.settings.database_url) as s:
            host = get_member(s, member).host
        return any(master.workers.get(host) in ("ALIVE", "DECOMMISSIONED") for master in self.masters.values())

    def check_reachable(self, member: str) -> None:
        """Every fake host answers."""

    def driver_python(self, version: str) -> str:
        return f"/fake/spark-{version}/bin/python"

    def stop_worker(self, member: str, grace: float = 0.0) -> None:
        self.stop_connect(member)
        with session_scope(self.settings.database_url) as s:
            row = get_member(s, member)
            host = row.host
            audit.record(s, "member.stop", "member", member, version=row.version)
        for master in self.masters.values():
            if master.workers.pop(host, None) is not None:
                for driver in master.drivers.values():  # Spark's master: drivers of a lost worker end in ERROR
                    if driver.host == host and driver.state in ("SUBMITTED", "RUNNING"):
                        driver.state = "ERROR"
        self.executors.pop(member, None)

    def decommission(self, member: str) -> None:
        with session_scope(self.settings.database_url) as s:
            row = get_member(s, member)
            version, host = row.version, row.host
        self.master(version).decommission(host)
        with session_scope(self.settings.database_url) as s:
            audit.record(s, "member.decommission", "member", member, version=version)

    # -- for tests ------------------------------------------------------------------------------------
    def driver(self, submission_id: str) -> FakeDriver:
        return next(m.drivers[submission_id] for m in self.masters.values() if submission_id in m.drivers)

    def _worker(self, member: Member) -> str | None:
        master = self.masters.get(member.version)
        return master.workers.get(member.host) if master else None
