"""What every sink declaration answers."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from changeover.errors import ChangeoverError
from changeover.handoff import fence
from changeover.registry import db

GUARANTEES = ("exactly-once", "idempotent", "at-least-once")
T = TypeVar("T")


class StoodDown(ChangeoverError):
    """The driver stopped its queries: it could not confirm that it is its job's current run. A write waiting for
    the registry gives up, so its batch fails with nothing of it logged, and is replayed once the run is confirmed."""


def run_without_writing(batch: Any) -> None:
    """A replayed batch whose write is on record: it still runs, so its state stores commit their version (Spark
    4.2 fails a foreachBatch query whose stateful batch did not run: STATE_STORE_COMMIT_VALIDATION_FAILED)."""
    batch.write.format("noop").mode("overwrite").save()


@dataclass(frozen=True)
class WriteContext:
    registry_url: str
    job: str
    stage: str
    run_id: int  # the writing run (its fencing epoch is read under the fence: `fence.Held.epoch`)
    checkpoint: str | None = None  # the stage's checkpoint folder, where Spark logs each batch's offsets
    # set when the driver stands down (`Driver.fence_self`); one per start of the queries, shared by their writes
    stand_down: threading.Event = field(default_factory=threading.Event, compare=False, repr=False)
    # a primed follower's catch-up in the job's own queries (`runtime.follower.InQueryReplay`): (stage, batch, batch id)
    # -> True when the batch was its predecessor's, run without writing
    replay: Callable[[str, Any, int], bool] | None = field(default=None, compare=False, repr=False)

    def hold(self, batch_id: int) -> AbstractContextManager[fence.Held]:
        """The fence around a batch's write (`fence.hold`); a primed follower's wait in it ends when the driver
        stands down or stops its queries."""
        return fence.hold(self.registry_url, self.job, self.run_id, self.stage, batch_id, self.stand_down)

    def patiently(self, call: Callable[[], T], what: str) -> T:
        """A write's database call, waited for while the database does not answer (`db.patiently`), and given up
        as soon as the driver stands down."""
        return db.patiently(call, what, while_waiting=self._unless_stood_down)

    def _unless_stood_down(self, _waited_for: BaseException) -> None:
        if self.stand_down.is_set():
            raise StoodDown(f"write of stage {self.stage} of job {self.job} by run {self.run_id}",
                            "the driver could not confirm that the run is still its job's current one, and stopped "
                            "its queries", "nothing to do: the batch is replayed once the registry confirms the run")


def foreach_batch(frame: Any, context: WriteContext, write: Callable[[Any, int], Any]) -> Any:
    """frame.writeStream with each batch given to `write`, but for a primed follower's catch-up, whose batches are
    its predecessor's: those run without writing (`WriteContext.replay`)."""
    def each(batch: Any, batch_id: int) -> None:
        if context.replay is None or not context.replay(context.stage, batch, batch_id):
            write(batch, batch_id)
    return frame.writeStream.foreachBatch(each)


class Sink(ABC):
    kind: ClassVar[str]
    # exactly-once: replayed batches are recognised and skipped; idempotent: written again with the same
    # result; at-least-once: a replayed batch is delivered twice.
    guarantee: str
    output_modes: ClassVar[tuple[str, ...]] = ("append", "update", "complete")
    # Every sink's write refuses a superseded run's batch inside the write itself (`handoff.fence`).

    @abstractmethod
    def attach(self, frame: Any, context: WriteContext) -> Any:
        """frame.writeStream with this sink set: a DataStreamWriter, query name and checkpoint still unset."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """A JSON description, enough for the control plane to rebuild this declaration."""

    @classmethod
    @abstractmethod
    def from_description(cls, description: dict[str, Any]) -> Sink: ...

    @abstractmethod
    def progress(self, context: WriteContext) -> int | None:
        """The newest batch the sink has recorded as written for this stage, None before any."""

    def written_by(self, context: WriteContext) -> bool | None:
        """Whether the sink's own store holds a batch of the stage that run `context.run_id` wrote; None when the
        registry's record of that run's first write cannot miss one (it commits in the same transaction). A sink
        with a store of its own answers, so that a crash between its commit and the registry's cannot hide a
        successor's write from the run it replaced."""
        return None

    def snapshot(self, context: WriteContext, batch: int, target: Path) -> None:
        """Save what a rewind to `batch` needs beside the checkpoint (most sinks keep it themselves)."""
        return None

    @abstractmethod
    def rewind(self, context: WriteContext, batch: int | None, saved: Path | None) -> str:
        """Make the sink as it was after `batch` (None: before any), so replayed batches are written again.
        Returns what was done, for the audit."""

    def shadow(self, batch: Any, scratch: Path) -> None:
        """A read-only follower's stand-in for this sink's write (`runtime.follower`): the batch is computed and its
        state committed, and nothing reaches the sink. A sink may write it to `scratch` as it would write it, so the
        follower's first real write finds its writer's classes loaded; the scratch is dropped. It must run the whole
        batch once, as the sink's write does, so that its state stores commit."""
        run_without_writing(batch)

    @abstractmethod
    def redirected(self, suffix: str) -> Sink:
        """The same sink writing elsewhere, for a read-only run beside the real one."""
