"""A user's job and the changes the compatibility matrix makes to it, written as Spark's guide writes queries.

`build(spark, ctx)` gives the base job, or the base with one change when ctx.options["variant"] names one.
"""

from __future__ import annotations

from typing import Any

from changeover.runtime import Files, ForeachBatch, JobContext, Stage
from pyspark.sql import functions as F

SCHEMA = "key STRING, ts TIMESTAMP, v BIGINT, k2 INT"


def latest_counts(out: str) -> Any:
    def write(batch: Any, batch_id: int) -> None:  # idempotent: a replayed batch rewrites its own folder
        batch.write.mode("overwrite").json(f"{out}/batch={batch_id}")

    return write


def build(spark: Any, ctx: JobContext) -> list[Stage]:
    variant, folder = ctx.options.get("variant", "base"), ctx.options["input"]
    events = spark.readStream.schema(SCHEMA).json(f"{folder}/events")
    if variant == "source_added":
        events = events.unionByName(spark.readStream.schema(SCHEMA).json(f"{folder}/more-events"))

    totals_input = events.where(F.col("v") >= 0) if variant == "filter_added" else events
    if variant == "count_to_sum":
        totals = totals_input.groupBy("key").agg(F.sum("v").alias("count"))
    elif variant == "key_type":
        totals = totals_input.withColumn("key", F.length("key")).groupBy("key").count()
    else:
        totals = totals_input.groupBy("key").count()

    watermarked = events.withWatermark("ts", "10 seconds")
    if variant == "window_size":
        window = F.window("ts", "20 seconds", "5 seconds")
    elif variant == "session_window":
        window = F.session_window("ts", "5 seconds")
    else:
        window = F.window("ts", "10 seconds", "5 seconds")
    windows = watermarked.groupBy(window, "key").count()

    unique = events.dropDuplicates(["key"] if variant == "dedup_columns" else ["key", "k2"])
    cleaned = events.select("key", ("v" if variant != "map_renamed" else F.col("v").alias("value")))

    out = ctx.options.get("output", f"{folder}/out")
    stages = [
        Stage("running_totals" if variant == "stage_renamed" else "totals", totals,
              ForeachBatch(latest_counts(f"{out}/totals"), guarantee="idempotent"), output_mode="update"),
        Stage("windows", windows, Files(f"{out}/windows", "json"), output_mode="append"),
        Stage("cleaned", cleaned, Files(f"{out}/cleaned", "json")),
    ]
    if variant != "stage_removed":
        stages.append(Stage("unique", unique, Files(f"{out}/unique", "json")))
    if variant == "stateful_stage_added":
        stages.append(Stage("per_k2", events.groupBy("k2").count(),
                            ForeachBatch(latest_counts(f"{out}/per_k2"), guarantee="idempotent"), output_mode="update"))
    return stages
