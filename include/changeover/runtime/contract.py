"""The job contract: `build(spark, ctx)` returns named stages, each an ordinary streaming DataFrame with
its output mode, its trigger and a declared sink. Changeover adds only the query name and the checkpoint."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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


@dataclass(frozen=True)
class JobContext:
    job: str
    run_id: int  # a foreachBatch function's third argument is the fencing epoch, which can change with ownership
    options: dict[str, Any] = field(default_factory=dict)
