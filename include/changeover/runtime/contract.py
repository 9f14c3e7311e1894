"""The job contract: `build(spark, ctx)` returns named stages, each an ordinary streaming DataFrame with
its output mode, its trigger and a declared sink. Changeover adds only the query name and the checkpoint."""

from __future__ import annotations

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
