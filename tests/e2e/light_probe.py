"""A client of light SQL that asks once a second, as a dashboard would, and records every answer."""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from changeover import light
from changeover.errors import ChangeoverError
from changeover.settings import Settings

PROBE_SQL = "SELECT split(version(), ' ')[0] AS version, sum(id) AS total FROM range(1000)"


@dataclass
class Answer:
    at: float
    seconds: float
    routed: str | None = None  # the version group it was routed to
    answered: str | None = None  # the version the executing server reported in the result
    refusals: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class SqlProbe:
    settings: Settings
    interval: float = 1.0
    answers: list[Answer] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> SqlProbe:
        self._thread = threading.Thread(target=self._run, name="sql-probe", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop asking, and close the pooled sessions: their gRPC channels would go on reconnecting in the test
        process after the cluster is gone, and a later fork of that process (a local Spark's JVM) ran into them once
        (JAVA_GATEWAY_EXITED, gRPC's poller seeing a bad file descriptor)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(120)
        light.close_pool()

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            answer = Answer(at=time.time(), seconds=0.0)
            try:
                with light.session(self.settings, statement=PROBE_SQL, reuse=True) as job:
                    row = job.spark.sql(PROBE_SQL).collect()[0]
                answer.routed, answer.answered, answer.refusals = job.route.version, row["version"], len(job.refusals)
                if row["total"] != 499500:
                    answer.error = f"wrong total {row['total']}"
            except (ChangeoverError, Exception) as exc:  # noqa: BLE001 - every failure is counted, not raised
                answer.error = f"{type(exc).__name__}: {exc}"[:300]
            answer.seconds = time.monotonic() - began
            self.answers.append(answer)
            self._stop.wait(max(0.0, self.interval - answer.seconds))

    def between(self, start: float, end: float) -> list[Answer]:
        return [a for a in self.answers if start <= a.at <= end]


def figures(answers: list[Answer]) -> dict[str, Any]:
    took = sorted(a.seconds for a in answers if a.ok)
    return {
        "queries": len(answers),
        "succeeded": sum(a.ok for a in answers),
        "success_rate": round(sum(a.ok for a in answers) / len(answers), 4) if answers else None,
        "p50_ms": round(1000 * statistics.median(took)) if took else None,
        "p99_ms": round(1000 * took[min(len(took) - 1, round(0.99 * (len(took) - 1)))]) if took else None,
        "rerouted": sum(a.refusals for a in answers),
        "errors": [a.error for a in answers if not a.ok][:10],
    }
