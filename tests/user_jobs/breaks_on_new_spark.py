"""A user's job whose code breaks on a newer Spark: it counts click events per key into a keyed table (and, with the
option `output`, also writes each event to parquet files), but a function it applies fails on the version its
`broken_on` option names, as a call removed in that version would, on the first batch it runs there. With the option
`slow_on` it runs on that version instead, but slowly (a call that became expensive there): 50 ms an event."""

from __future__ import annotations

import time
from typing import Any

from changeover.runtime import Files, JobContext, KeyedTable, Stage
from changeover.settings import registry_url
from pyspark.sql import functions as F


def build(spark: Any, ctx: JobContext) -> list[Stage]:
    broken = spark.version == ctx.options.get("broken_on")
    slow = spark.version == ctx.options.get("slow_on")

    @F.udf("string")
    def checked(key: str) -> str:
        if broken:
            raise RuntimeError(f"this job's code does not run on Spark {ctx.options['broken_on']}")
        if slow:
            time.sleep(0.05)
        return key

    events = spark.readStream.schema("key string, ts timestamp, seq long").json(ctx.options["landing"])
    totals = events.select(checked("key").alias("key")).groupBy("key").count()
    stages = [Stage("totals", totals, KeyedTable(registry_url(), f"{ctx.job}_totals", keys=("key",)), "update",
                    "1 second")]
    if "output" in ctx.options:  # a second stage, into a sink Changeover cannot fence
        stages.append(Stage("events", events.select(checked("key").alias("key"), "seq"), Files(ctx.options["output"])))
    return stages
