"""What a job module gives the runtime: named stages, each a streaming query with its own checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# A stage maps each micro-batch to rows of (result_key: string, value: long) for the idempotent sink.
ResultMapper = Callable[[Any], Any]


@dataclass(frozen=True)
class Stage:
    name: str
    frame: Any  # a streaming pyspark DataFrame
    output_mode: str
    to_results: ResultMapper


@dataclass(frozen=True)
class JobContext:
    job: str
    run_id: int
    options: dict[str, Any] = field(default_factory=dict)
    should_stop: Callable[[], bool] = lambda: False
