"""A batch job that must not be interrupted (block_shutdown): a report computed in rounds."""

from __future__ import annotations

import time

from changeover.runtime import JobContext


def run(spark, ctx: JobContext) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + float(ctx.options.get("duration_seconds", 60))
    rounds = 0
    while time.monotonic() < deadline:
        spark.range(200_000).selectExpr("sum(id % 97) as s").collect()
        rounds += 1
        time.sleep(1.0)
    print(f"nightly_report: {rounds} rounds", flush=True)
