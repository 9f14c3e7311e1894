"""A user's own foreachBatch function.

Changeover calls it inside the fence, so a superseded run's call is refused before it starts, and passes the
batch id and the run's fencing epoch for a function that checks the epoch in its own transaction. The user
marks it idempotent (a replayed batch writes the same result) or at-least-once (a replay duplicates).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

from sqlalchemy import delete, func, select

from changeover import faults
from changeover.errors import ChangeoverError
from changeover.registry.db import session_scope
from changeover.registry.models import SinkLedger
from changeover.runtime.sinks.base import Sink, WriteContext, foreach_batch

BatchFunction = Callable[..., None]  # (batch_df, batch_id) or (batch_df, batch_id, epoch)


def _discard(frame: Any, batch_id: int, epoch: int) -> None:
    """A read-only run's stand-in: the batch is computed, nothing is delivered."""
    frame.count()


def deliver(function: BatchFunction, context: WriteContext, batch: Any, batch_id: int) -> None:
    """One batch to the user's function inside the fence. A registry that restarts or drops the connection is waited
    for (patiently, with its deadline), and the batch delivered again: at-least-once or idempotent, as declared.
    A replayed batch is delivered again too: the ledger is keyed by batch id, and a batch id can come back with other
    data (a job started again on a fresh checkpoint), so it records deliveries and never skips one."""
    takes_epoch = len(inspect.signature(function).parameters) >= 3

    def once() -> None:
        with context.hold(batch_id) as held:
            function(batch, batch_id, held.epoch) if takes_epoch else function(batch, batch_id)
            faults.reached_in_job("foreach.delivered")  # in the user's store, not yet recorded in the registry
            held.session.merge(SinkLedger(job=context.job, stage=context.stage, batch_id=batch_id, rows=0,
                               run_id=context.run_id))

    context.patiently(once, f"job {context.job} stage {context.stage} batch {batch_id}: the registry")


@dataclass(frozen=True)
class ForeachBatch(Sink):
    function: BatchFunction | None
    guarantee: str = "at-least-once"
    kind: ClassVar[str] = "foreach"

    def __post_init__(self) -> None:
        if self.guarantee not in ("idempotent", "at-least-once"):
            raise ChangeoverError(f"foreachBatch guarantee {self.guarantee!r}",
                                  "Changeover cannot see inside a user's function, so it cannot make it exactly-once",
                                  "declare it idempotent (replays write the same result) or at-least-once")

    def attach(self, frame: Any, context: WriteContext) -> Any:
        function = self.function
        if function is None:
            raise ChangeoverError(f"foreachBatch sink of stage {context.stage}", "it has no function",
                                  "pass the function: ForeachBatch(my_function, guarantee=...)")
        return foreach_batch(frame, context, functools.partial(deliver, function, context))

    def describe(self) -> dict[str, Any]:
        name = getattr(self.function, "__qualname__", None)
        return {"kind": self.kind, "guarantee": self.guarantee, "function": name}

    @classmethod
    def from_description(cls, description: dict[str, Any]) -> ForeachBatch:
        return cls(None, description.get("guarantee", "at-least-once"))

    def progress(self, context: WriteContext) -> int | None:
        with session_scope(context.registry_url) as s:
            return s.scalar(select(func.max(SinkLedger.batch_id)).where(
                SinkLedger.job == context.job, SinkLedger.stage == context.stage))

    def rewind(self, context: WriteContext, batch: int | None, saved: Path | None) -> str:
        """Only the ledger: the user's own store is theirs. Idempotent replays overwrite it; at-least-once ones
        duplicate, which the caller must have accepted."""
        with session_scope(context.registry_url) as s:
            s.execute(delete(SinkLedger).where(SinkLedger.job == context.job, SinkLedger.stage == context.stage,
                                               SinkLedger.batch_id > (-1 if batch is None else batch)))
        return f"batches after {batch} will be delivered again ({self.guarantee})"

    def redirected(self, suffix: str) -> ForeachBatch:
        return replace(self, function=_discard)
