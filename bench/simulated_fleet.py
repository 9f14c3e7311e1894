"""A large fleet for benchmarks: members and running jobs in the real registry, their masters the test double of
`tests/fake_fleet.py` (in memory, counting calls). It starts no process; the real backend is `cluster.membership_for`.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from changeover.registry.db import session_scope  # noqa: E402
from changeover.registry.models import Job, JobRun, Member, utcnow  # noqa: E402
from changeover.settings import Settings  # noqa: E402
from fake_fleet import FakeFleet, FakeMaster  # noqa: E402

VERSION = "4.2.0"


class SimulatedFleet(FakeFleet):
    """`members` members of one version group, `jobs` running fault-tolerant jobs spread over them."""

    def __init__(self, settings: Settings, members: int, jobs: int) -> None:
        super().__init__(settings)
        self.ensure_master(VERSION)
        self.hosts = {f"m{i:04d}": f"127.{1 + i // 250}.{i % 250}.1" for i in range(members)}
        with session_scope(settings.database_url) as s:
            for name, host in self.hosts.items():
                s.add(Member(name=name, version=VERSION, host=host, status="ACTIVE"))
                self.master_.workers[host] = "ALIVE"
            s.flush()
            now, names = utcnow(), list(self.hosts)
            for j in range(jobs):
                member = names[j % members]
                submission = self.master_.create({"appArgs": []})
                self.driver(submission).host = self.hosts[member]
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
        self.master_.calls.clear()

    @property
    def master_(self) -> FakeMaster:
        return self.masters[VERSION]
