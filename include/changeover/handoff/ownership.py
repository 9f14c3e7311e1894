"""A run taking its job over (`own_job`): the job's current run changes, and a change of the job's code that
brings is audited. Outside `registry/`, which the audit trail is written on, so the registry imports no audit."""

from __future__ import annotations

from typing import Any

from changeover import audit
from changeover.registry.models import Job, JobRun


def own_job(s: Any, job: Job, run: JobRun, why: str) -> None:
    """`run` owns the job from now on (`Job.make_current`); a change of the job's code that brings is on record."""
    before = job.code
    if job.make_current(run):
        audit.record(s, "job.update_code", "job", job.name, before=before, after=job.code, run=run.id, reason=why)
