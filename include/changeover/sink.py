"""An idempotent SQL sink: a batch id already in the ledger is skipped, and rows are upserts."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
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
