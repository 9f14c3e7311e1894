"""A stream-stream join into a keyed SQL table: each click event joined with its impression, by sequence number.

Both sides read the generator's landing folder (the same events arrive as impressions and as clicks), so every
event has exactly one match, within the time bound the watermarks need to purge the join's state.
"""

from __future__ import annotations

from typing import Any

from changeover.runtime import JobContext, KeyedTable, Stage
from changeover.settings import registry_url
from pyspark.sql import functions as F
from pyspark.sql.types import LongType, StringType, StructField, StructType, TimestampType

SCHEMA = StructType([StructField("key", StringType()), StructField("ts", TimestampType()),
                     StructField("seq", LongType())])


def sink(job: str, url: str) -> KeyedTable:
    return KeyedTable(url, f"{job}_matches", keys=("seq",))


def build(spark: Any, ctx: JobContext) -> list[Stage]:
    def side(prefix: str) -> Any:
        events = spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 20).json(ctx.options["landing"])
        return events.select(*(F.col(c).alias(f"{prefix}_{c}") for c in SCHEMA.fieldNames())).withWatermark(
            f"{prefix}_ts", "10 seconds")

    impressions, clicks = side("imp"), side("click")
    matches = impressions.join(clicks, F.expr(
        "imp_seq = click_seq AND click_ts BETWEEN imp_ts AND imp_ts + interval 5 seconds"))
    rows = matches.select(F.col("imp_seq").alias("seq"), F.col("imp_key").alias("key"),
                          F.date_format("click_ts", "yyyy-MM-dd HH:mm:ss.SSS").alias("clicked_at"))
    url = ctx.options.get("sink_url") or registry_url()
    return [Stage("matches", rows, sink(ctx.job, url), "append", ctx.options.get("trigger", "1 second"))]
