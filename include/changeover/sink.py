"""An idempotent SQL sink: a batch id already in the ledger is skipped, and rows are upserts."""

from __future__ import annotations

from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.dialects import postgresql, sqlite

from changeover.registry.db import session_scope
from changeover.registry.models import SinkLedger, StageResult


def _insert(dialect: str) -> Any:
    return (postgresql if dialect == "postgresql" else sqlite).insert


def write_batch(url: str, job: str, stage: str, batch_id: int, rows: list[tuple[str, int]]) -> bool:
    """Write one micro-batch's results. False when this batch was written before."""
    with session_scope(url) as s:
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
