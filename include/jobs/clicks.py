"""The demo's stateful streaming job: JSON click events from a landing folder, two named stages."""

from __future__ import annotations

from changeover.stages import JobContext, Stage
from pyspark.sql import functions as F
from pyspark.sql.types import LongType, StringType, StructField, StructType, TimestampType

SCHEMA = StructType([
    StructField("key", StringType()),
    StructField("ts", TimestampType()),
    StructField("seq", LongType()),
])
WINDOW = "10 seconds"


def build(spark, ctx: JobContext) -> list[Stage]:  # type: ignore[no-untyped-def]
    events = (
        spark.readStream.schema(SCHEMA)
        .option("maxFilesPerTrigger", int(ctx.options.get("max_files_per_trigger", 20)))
        .json(ctx.options["landing"])
    )
    totals = events.groupBy("key").count()
    windows = events.withWatermark("ts", WINDOW).groupBy(F.window("ts", WINDOW), "key").count()
    # Options for job updates: which stages this version has, and under which names.
    names = {"totals": "totals", "windows": "windows", **ctx.options.get("stage_names", {})}
    wanted = ctx.options.get("stages", ["totals", "windows"])
    stages = [
        Stage(names["totals"], totals, "update",
              lambda df: df.select(F.col("key"), F.col("count"))),
        Stage(names["windows"], windows, "append",
              lambda df: df.select(F.concat_ws("@", "key", F.col("window.start").cast("string")), F.col("count"))),
    ]
    return [stage for stage, base in zip(stages, ["totals", "windows"], strict=True) if base in wanted]
