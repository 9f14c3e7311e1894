"""An idempotent SQL sink: a batch id already in the ledger is skipped, and rows are upserts."""

from __future__ import annotations

from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.dialects import postgresql, sqlite

from changeover.errors import ChangeoverError
from changeover.registry.db import lock_row, session_scope
from changeover.registry.models import Job, JobRun, SinkLedger, StageResult, utcnow


class Fenced(ChangeoverError):
    """A run that is no longer its job's current run tried to write: its output must not land."""


def _insert(dialect: str) -> Any:
    return (postgresql if dialect == "postgresql" else sqlite).insert


def write_batch(
    url: str, job: str, stage: str, batch_id: int, rows: list[tuple[str, int]], run_id: int | None = None
) -> bool:
    """Write one micro-batch's results. False when this batch was written before.

    With run_id, the write is fenced: it lands only while that run is the job's current run, decided under
    the job row's lock, the same lock a parked run takes to reclaim the job when its lease runs out.
    """
    with session_scope(url) as s:
        if run_id is not None:
            _check_fence(s, job, run_id)
        if s.get(SinkLedger, (job, stage, batch_id)) is not None:
            return False
        if rows:
            insert = _insert(s.bind.dialect.name)  # type: ignore[union-attr]
            values = [
                {"job": job, "stage": stage, "result_key": k, "value": int(v), "batch_id": batch_id} for k, v in rows
            ]
            stmt = insert(StageResult).values(values)
            stmt = stmt.on_conflict_do_update(
                index_elements=["job", "stage", "result_key"],
                set_={"value": stmt.excluded.value, "batch_id": stmt.excluded.batch_id},
            )
            s.execute(stmt)
        s.add(SinkLedger(job=job, stage=stage, batch_id=batch_id, rows=len(rows)))
    return True


def _check_fence(s: Any, job: str, run_id: int) -> None:
    row = lock_row(s, Job, job)
    if row is None or row.current_run_id != run_id:
        raise Fenced(f"write of job {job} by run {run_id}",
                     f"run {row.current_run_id if row else None} is the job's current run now",
                     "nothing to do: this run was superseded and stops; its output is written by the current run")
    run = s.get(JobRun, run_id)
    if run is not None and run.first_write_at is None:
        run.first_write_at = utcnow()


def results(url: str, job: str, stage: str) -> dict[str, int]:
    with session_scope(url) as s:
        rows = s.execute(
            select(StageResult.result_key, StageResult.value).where(StageResult.job == job, StageResult.stage == stage)
        )
        return {k: v for k, v in rows}


def progress(url: str, job: str) -> dict[str, int]:
    """The newest batch the sink has written, per stage."""
    with session_scope(url) as s:
        newest = func.max(SinkLedger.batch_id)
        rows = s.execute(select(SinkLedger.stage, newest).where(SinkLedger.job == job).group_by(SinkLedger.stage))
        return {stage: int(batch) for stage, batch in rows}


def rewind(url: str, job: str, stage: str, batch: int | None) -> int:
    """Forget what the sink wrote after `batch`, so that replaying those batches writes them again."""
    floor = -1 if batch is None else batch
    with session_scope(url) as s:
        ledger = s.execute(delete(SinkLedger).where(
            SinkLedger.job == job, SinkLedger.stage == stage, SinkLedger.batch_id > floor))
        s.execute(delete(StageResult).where(
            StageResult.job == job, StageResult.stage == stage, StageResult.batch_id > floor))
        return int(ledger.rowcount or 0)
