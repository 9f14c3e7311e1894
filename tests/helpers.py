"""Shared by the integration tests: waiting on conditions with deadlines, never fixed sleeps."""

from __future__ import annotations

from changeover import jobs
from changeover.cluster import LocalCluster, wait_for
from changeover.registry.models import JobRun
from changeover.settings import Settings


def wait_for_commit(settings: Settings, cluster: LocalCluster, job: str, timeout: float = 240) -> JobRun:
    def committed() -> bool:
        run = jobs.refresh(settings, cluster, job)
        assert run is not None and run.state not in ("FAILED", "KILLED"), f"{job} ended: {run and run.error}"
        return run.first_commit_at is not None

    wait_for(committed, timeout, f"job {job} committing a batch")
    run = jobs.refresh(settings, cluster, job)
    assert run is not None
    return run
