"""The registry's records of jobs and their runs, as the launch, the savepoints and the control plane read them."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from changeover.errors import ChangeoverError
from changeover.registry.models import Job, JobRun
from changeover.registry.states import LIVE, RunState

STANDBY = RunState.STANDBY  # a warm successor waiting for its checkpoint: alive, but not the job's current run
__all__ = ["LIVE", "STANDBY", "current_run", "get_job"]


def get_job(s: Any, name: str) -> Job:
    job = s.get(Job, name)
    if job is None:
        known = ", ".join(s.scalars(select(Job.name).order_by(Job.name))) or "none"
        raise ChangeoverError(f"job {name!r}", f"no such job (known: {known})", "use a name from `changeover jobs`")
    return job


def current_run(s: Any, job: Job) -> JobRun | None:
    return s.get(JobRun, job.current_run_id) if job.current_run_id else None
