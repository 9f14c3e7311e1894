"""The job contract: `build(spark, ctx)` returns named stages, each an ordinary streaming DataFrame with
its output mode, its trigger and a declared sink. Changeover adds only the query name and the checkpoint."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from changeover.errors import ChangeoverError
from changeover.names import check_name

if TYPE_CHECKING:
    from changeover.runtime.sinks import Sink


@dataclass(frozen=True)
class Stage:
    name: str
    frame: Any  # a streaming pyspark DataFrame
    sink: Sink
    output_mode: str = "append"
    trigger: str = "1 second"  # a processing-time interval, Spark's default kind of trigger

    def __post_init__(self) -> None:
        check_name("stage", self.name)  # it names the stage's checkpoint folder and its state in savepoints
        modes = getattr(self.sink, "output_modes", None)
        if modes is not None and self.output_mode not in modes:
            raise ChangeoverError(f"stage {self.name} in {self.output_mode} mode", f"its {self.sink.kind} sink takes "
                                  f"{' or '.join(modes)} output only", "write the stage in append mode (an "
                                  "aggregation needs a watermark for it), or declare a keyed table as its sink")


_UNIT_SECONDS = {"millisecond": 0.001, "ms": 0.001, "second": 1.0, "sec": 1.0, "minute": 60.0, "min": 60.0,
                 "hour": 3600.0, "day": 86400.0}


def interval_seconds(trigger: str) -> float | None:
    """A processing-time trigger's interval in seconds, as Spark reads "1 second", "500 milliseconds", "interval 2
    minutes"; None for a form this does not read."""
    found = re.fullmatch(r"(?:interval\s+)?(\d+(?:\.\d+)?)\s*([a-z]+)", trigger.strip().lower())
    if found is None:
        return None
    unit = found.group(2)
    scale = _UNIT_SECONDS.get(unit) or _UNIT_SECONDS.get(unit.removesuffix("s"))
    return float(found.group(1)) * scale if scale is not None else None


@dataclass(frozen=True)
class JobContext:
    job: str
    run_id: int
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def epoch(self) -> int:
        """Kept for jobs written against it: the run's id. The fencing epoch, which grows with every change of the
        job's ownership, is the third argument a foreachBatch function is given."""
        return self.run_id


def unmatched_state(job: str, restored: set[str], stages: set[str]) -> str | None:
    """The stage rules of a job update: a new stage starts empty, a matching one is restored, and state of a
    stage the job no longer has is an error unless allow_non_restored_state is given (as in Flink)."""
    orphaned = sorted(restored - stages)
    if not orphaned:
        return None
    return (
        f"job {job}: refused to start: the savepoint holds state of stage(s) {', '.join(orphaned)}, "
        f"which the job no longer has (its stages: {', '.join(sorted(stages))}). "
        "Resume with --allow-non-restored-state to drop that state, or --rename-stage OLD=NEW to move it."
    )
