"""`changeover check`: a job's new code against one of its savepoints, before the running job is touched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from changeover import audit, savepoints
from changeover.compat import version_table
from changeover.compat.checker import Report, check
from changeover.compat.extract import stage_plans
from changeover.jobs import get_job
from changeover.registry.db import session_scope
from changeover.settings import Settings


def check_code(settings: Settings, code: str, savepoint: str, target_version: str | None = None,
               renames: dict[str, str] | None = None, options: dict[str, Any] | None = None) -> Report:
    """`savepoint` is JOB/NAME. The new code is built with the job's options unless others are given."""
    job_name, _, name = savepoint.partition("/")
    with session_scope(settings.database_url) as s:
        job = get_job(s, job_name)
        row = savepoints.get_savepoint(s, job_name, name)
        path, version, job_options = row.path, row.spark_version, dict(job.options or {})
    manifest = savepoints.verify(Path(path))
    plans = stage_plans(settings, job_name, code, {**job_options, **(options or {})}, target_version or version)
    report = check(job_name, savepoint, manifest["stages"], plans, renames)
    target = target_version or version
    if target != version:
        measured = version_table.cell(version, target)
        if measured is None:
            report.add("CO-VER-02", "(every stage)", f"Spark {version} to {target}")
        elif measured["outcome"] != "ok":
            report.add("CO-VER-01", "(every stage)", f"Spark {version} to {target}: {measured['outcome']}, "
                                                     f"{measured['reason']}")
    with session_scope(settings.database_url) as s:
        audit.record(s, "job.check", "job", job_name, outcome=report.verdict.name.lower(), code=code,
                     savepoint=savepoint, version=target,
                     rules=sorted({f.rule for f in report.findings}))
    return report
