"""A simulated membership backend for benchmarks only: masters that answer from memory, and count the calls.

It implements the observation half of `changeover.cluster.Membership` for the real registry and the real
drain code. It starts no process and is not shipped in `include/`: the real backend is `cluster.membership_for`.
"""

from __future__ import annotations

import secrets
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta

from changeover.registry.db import session_scope
from changeover.registry.models import Job, JobRun, Master, Member, utcnow
from changeover.settings import Settings
from changeover.spark_master import DriverStatus

VERSION = "4.2.0"


@dataclass
class SimulatedMaster:
    """One version group's master: its drivers (submission id -> worker host) and its workers' states."""

    drivers: dict[str, str] = field(default_factory=dict)
    workers: dict[str, str] = field(default_factory=dict)
    calls: Counter[str] = field(default_factory=Counter)

    def status(self, submission_id: str) -> DriverStatus:
        self.calls["status"] += 1
        host = self.drivers.get(submission_id)
        return DriverStatus(submission_id, "RUNNING" if host else "UNKNOWN", host, VERSION)

    def worker_state(self, host: str) -> str | None:
        self.calls["worker_state"] += 1
        return self.workers.get(host)

    def decommission(self, host: str) -> None:
        self.calls["decommission"] += 1
        self.workers[host] = "DECOMMISSIONED"


class SimulatedFleet:
    """Members and jobs in the registry, their drivers in a `SimulatedMaster`."""

    def __init__(self, settings: Settings, members: int, jobs: int) -> None:
        self.settings, self.master_ = settings, SimulatedMaster()
        self.hosts = {f"m{i:04d}": f"127.{1 + i // 250}.{i % 250}.1" for i in range(members)}
        with session_scope(settings.database_url) as s:
            s.add(Master(version=VERSION, host="127.0.0.1", port=1, webui_port=2, rest_port=3, status="RUNNING"))
            for name, host in self.hosts.items():
                s.add(Member(name=name, version=VERSION, host=host, status="ACTIVE"))
                self.master_.workers[host] = "ALIVE"
            s.flush()
            now, names = utcnow(), list(self.hosts)
            for j in range(jobs):
                member = names[j % members]
                submission = f"driver-{secrets.token_hex(6)}"
                job = Job(name=f"job{j:05d}", module="jobs.clicks", fault_tolerant=True, block_shutdown=False,
                          options={})
                s.add(job)
                s.flush()
                run = JobRun(job=job.name, spark_version=VERSION, master_url="spark://sim", state="RUNNING",
                             progress={}, member=member, submission_id=submission, heartbeat_at=now,
                             submitted_at=now - timedelta(minutes=5))
                s.add(run)
                s.flush()
                job.current_run_id = run.id
                self.master_.drivers[submission] = self.hosts[member]

    # -- Membership: observation ------------------------------------------------------------------
    def master(self, version: str) -> SimulatedMaster:
        return self.master_

    def executors_on(self, member: str) -> int:
        self.master_.calls["executors_on"] += 1
        return 0

    def is_decommissioned(self, member: str) -> bool:
        return self.master_.worker_state(self.hosts[member]) in (None, "DECOMMISSIONED", "DEAD")

    def decommission(self, member: str) -> None:
        self.master_.decommission(self.hosts[member])

    # -- Membership: processes, which a simulation does not have ----------------------------------------
    def ensure_master(self, version: str, port: int | None = None) -> Master:
        raise NotImplementedError("a simulated fleet starts no master")

    def stop_master_if_empty(self, version: str) -> bool:
        raise NotImplementedError("a simulated fleet stops no master")

    def start_worker(self, member: str, version: str) -> None:
        raise NotImplementedError("a simulated fleet starts no worker")

    def stop_worker(self, member: str, grace: float = 0.0) -> None:
        raise NotImplementedError("a simulated fleet stops no worker")
