"""Resuming an older savepoint, per sink kind: what the registry decides before any driver starts.

The savepoint here is its manifest's stage entries, as `savepoints.take` writes them; the real savepoints of
file sinks and keyed tables are resumed on real Spark in test_user_jobs.py and test_savepoints.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from changeover import audit
from changeover.errors import ChangeoverError
from changeover.registry.db import session_scope
from changeover.registry.models import Job, SinkLedger
from changeover.savepoints.restoring import _align_sinks
from changeover.settings import Settings
from sqlalchemy import func, select


def _written_up_to(settings: Settings, batch: int) -> None:
    with session_scope(settings.database_url) as s:
        s.add(Job(name="audit", module="click_audit", fault_tolerant=True, block_shutdown=False, options={}))
        for b in range(batch + 1):
            s.add(SinkLedger(job="audit", stage="audit", batch_id=b, rows=0, run_id=1))


def _newest(settings: Settings) -> int | None:
    with session_scope(settings.database_url) as s:
        return s.scalar(select(func.max(SinkLedger.batch_id)).where(SinkLedger.job == "audit"))


def _stage(guarantee: str) -> dict[str, object]:
    return {"audit": {"batch": 3, "replay_through": 4, "sink": {"kind": "foreach", "guarantee": guarantee}}}


def test_an_at_least_once_foreach_sink_ahead_is_refused_unless_duplicates_are_accepted(settings: Settings,
                                                                                      tmp_path: Path) -> None:
    _written_up_to(settings, 6)
    with pytest.raises(ChangeoverError, match=r"the foreach sink of stage audit is ahead of the savepoint: it wrote "
                                              r"up to batch 6, the savepoint stands at batch 3, so the replayed "
                                              r"batches would be delivered twice.*--accept-duplicates"):
        _align_sinks(settings, "audit", "older", tmp_path, _stage("at-least-once"), True, False)
    assert _newest(settings) == 6  # refused: nothing changed
    _align_sinks(settings, "audit", "older", tmp_path, _stage("at-least-once"), False, True)
    assert _newest(settings) == 3
    rewinds = [e for e in audit.find(settings.database_url, job="audit") if e.action == "sink.rewind"]
    assert [(e.details["from_batch"], e.details["to_batch"]) for e in rewinds] == [(6, 3)]


def test_an_idempotent_foreach_sink_is_written_again_without_asking(settings: Settings, tmp_path: Path) -> None:
    _written_up_to(settings, 6)
    _align_sinks(settings, "audit", "older", tmp_path, _stage("idempotent"), False, False)
    assert _newest(settings) == 3


def test_the_batch_a_savepoint_replays_goes_on_for_every_sink(settings: Settings, tmp_path: Path) -> None:
    """A move's stop can catch the next batch begun and delivered (its offsets are in the savepoint): the successor
    replays it with the same offsets. A keyed table's ledger skips it; an at-least-once function gets that one batch
    again, as it declared. Before, an at-least-once function's move was refused here on every try until its lease
    ran out."""
    _written_up_to(settings, 4)  # batch 4's offsets are in the savepoint: Spark replays it with the same ones
    keyed = {"audit": {"batch": 3, "replay_through": 4,
                       "sink": {"kind": "keyed_table", "url": settings.database_url, "table": "t", "keys": ["k"]}}}
    _align_sinks(settings, "audit", "older", tmp_path, keyed, False, False)
    _align_sinks(settings, "audit", "older", tmp_path, _stage("at-least-once"), False, False)
    assert _newest(settings) == 4
    with session_scope(settings.database_url) as s:
        s.add(SinkLedger(job="audit", stage="audit", batch_id=5, rows=0, run_id=1))
    with pytest.raises(ChangeoverError, match="would be delivered twice"):  # past the replayed batch: not a replay
        _align_sinks(settings, "audit", "older", tmp_path, _stage("at-least-once"), False, False)


def test_a_rewind_asked_for_takes_back_the_batch_the_savepoint_replays(settings: Settings, tmp_path: Path) -> None:
    """A rollback to other code: the replayed batch is written again by the code resumed, not kept as the
    code it replaces wrote it."""
    _written_up_to(settings, 4)
    _align_sinks(settings, "audit", "older", tmp_path, _stage("idempotent"), False, False)
    assert _newest(settings) == 4  # not asked: the replay writes the same result over it
    _align_sinks(settings, "audit", "older", tmp_path, _stage("idempotent"), True, False)
    assert _newest(settings) == 3
    rewinds = [e for e in audit.find(settings.database_url, job="audit") if e.action == "sink.rewind"]
    assert [(e.details["from_batch"], e.details["to_batch"]) for e in rewinds] == [(4, 3)]


def test_a_savepoint_that_does_not_name_its_sinks_is_refused(settings: Settings, tmp_path: Path) -> None:
    _written_up_to(settings, 4)
    with pytest.raises(ChangeoverError, match="the savepoint does not say which sink stage audit writes"):
        _align_sinks(settings, "audit", "older", tmp_path, {"audit": {"batch": 3}}, True, True)
