"""The demo's stateful streaming job: JSON click events from a landing folder, two named stages, each
upserting into a keyed SQL table (the registry's database unless the job's options name another)."""

from __future__ import annotations

from typing import Any

from changeover.runtime import JobContext, KeyedTable, Stage
from changeover.settings import registry_url
from pyspark.sql import functions as F
from pyspark.sql.types import LongType, StringType, StructField, StructType, TimestampType

SCHEMA = StructType([
    StructField("key", StringType()),
    StructField("ts", TimestampType()),
    StructField("seq", LongType()),
])
WINDOW = "10 seconds"


def sinks(job: str, url: str) -> dict[str, KeyedTable]:
    return {"totals": KeyedTable(url, f"{job}_totals", keys=("key",)),
            "windows": KeyedTable(url, f"{job}_windows", keys=("key", "window_start"))}


def build(spark: Any, ctx: JobContext) -> list[Stage]:
    events = (
        spark.readStream.schema(SCHEMA)
        .option("maxFilesPerTrigger", int(ctx.options.get("max_files_per_trigger", 20)))
        .json(ctx.options["landing"])
    )
    totals = events.groupBy("key").count()
    windows = (events.withWatermark("ts", WINDOW).groupBy(F.window("ts", WINDOW), "key").count()
               .select("key", F.date_format("window.start", "yyyy-MM-dd HH:mm:ss").alias("window_start"), "count"))
    declared = sinks(ctx.job, ctx.options.get("sink_url") or registry_url())
    trigger = ctx.options.get("trigger", "1 second")
    # Options for job updates: which stages this version has, and under which names.
    names = {"totals": "totals", "windows": "windows", **ctx.options.get("stage_names", {})}
    wanted = ctx.options.get("stages", ["totals", "windows"])
    stages = [
        Stage(names["totals"], totals, declared["totals"], "update", trigger),
        Stage(names["windows"], windows, declared["windows"], "append", trigger),
    ]
    return [stage for stage, base in zip(stages, ["totals", "windows"], strict=True) if base in wanted]


def results(url: str, job: str) -> tuple[dict[str, int], dict[str, int]]:
    """What the sinks hold: totals per key, and counts per "key@window start"."""
    declared = sinks(job, url)
    totals, windows = {}, {}
    for table, into in ((declared["totals"], totals), (declared["windows"], windows)):
        for row in table.read():
            key = f"{row['key']}@{row['window_start']}" if "window_start" in row else row["key"]
            into[key] = int(row["count"])
    return totals, windows
