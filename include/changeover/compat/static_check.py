"""`changeover check`: a job's new code against one of its savepoints, before the running job is touched.

The static check compares stage plans with the savepoint's manifest; the dry run then replays a batch of
each restored stage on the target runtime, from scratch copies (`changeover.compat.dry_run`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from changeover import audit, savepoints
from changeover.cluster.shipping import JobCode
from changeover.compat import rescale_check, version_table
from changeover.compat.checker import Report, check
from changeover.compat.dry_run import dry_run as replay_on
from changeover.compat.extract import describe_stages_of, shipped_code
from changeover.registry.db import session_scope
from changeover.registry.records import get_job
from changeover.settings import Settings


def check_code(settings: Settings, code: str | None, savepoint: str, target_version: str | None = None,
               renames: dict[str, str] | None = None, options: dict[str, Any] | None = None, *,
               dry_run: bool = False, strict: bool = False, dry_run_timeout: float = 180,
               state_partitions: int | None = None) -> Report:
    """`savepoint` is JOB/NAME; `code` None means the job's own code (a version upgrade). The new code is built
    with the job's options unless others are given. With `state_partitions`, whether each stage's state can move to
    that many partitions, and the dry run replays its batch on a repartitioned copy."""
    job_name, _, name = savepoint.partition("/")
    with session_scope(settings.database_url) as s:
        job = get_job(s, job_name)
        row = savepoints.get_savepoint(s, job_name, name)
        path, version, job_options = Path(row.path), row.spark_version, dict(job.options or {})
        shipped = (shipped_code(settings, job_name, code) if code is not None
                   else JobCode(job.module, job.entry, Path(job.code or "")))
    manifest = savepoints.verify(path)
    target = target_version or version
    options = {**job_options, **(options or {})}
    plans = describe_stages_of(settings, job_name, shipped, options, target)
    report = check(job_name, savepoint, manifest["stages"], plans, renames, strict=strict)
    if target != version:
        measured = version_table.cell(version, target)
        if measured is None:
            report.add("CO-VER-02", "(every stage)", f"Spark {version} to {target}")
        elif measured["outcome"] != "ok":
            report.add("CO-VER-01", "(every stage)", f"Spark {version} to {target}: {measured['outcome']}, "
                                                     f"{measured['reason']}")
    moving: list[str] = []
    if state_partitions is not None:
        moving = rescale_check.add_findings(report, path, list(manifest["stages"]), target, state_partitions)
    replayed: dict[str, Any] = {}
    if dry_run:
        renames = dict(renames or {})
        kept = [stage for stage in manifest["stages"] if renames.get(stage, stage) in plans]
        rescaled = {renames.get(stage, stage): state_partitions for stage in moving if state_partitions}
        replayed = replay_on(settings, report, shipped, path, kept, target, options, renames, dry_run_timeout,
                             rescaled)
        report.dry_run = replayed
    with session_scope(settings.database_url) as s:
        audit.record(s, "job.check", "job", job_name, outcome=report.verdict.name.lower(),
                     code=code or "(its own)", savepoint=savepoint, version=target, dry_run=dry_run,
                     replayed={stage: r.get("batch") for stage, r in replayed.items() if isinstance(r, dict)},
                     **({"state_partitions": state_partitions} if state_partitions is not None else {}),
                     rules=sorted({f.rule for f in report.findings}))
    return report
