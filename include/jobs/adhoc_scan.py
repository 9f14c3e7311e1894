"""An ad-hoc batch job with neither checkpoints nor block_shutdown: a drain cancels it after its timeout."""

from __future__ import annotations

import time

from changeover.runtime import JobContext


def run(spark, ctx: JobContext) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + float(ctx.options.get("duration_seconds", 3600))
    while time.monotonic() < deadline:
        spark.range(100_000).selectExpr("max(id)").collect()
        time.sleep(2.0)
