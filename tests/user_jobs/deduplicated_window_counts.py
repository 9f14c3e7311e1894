"""A team's job as Spark's Structured Streaming guide writes its parts: events read from JSON files, duplicates
dropped on their id within the watermark ("Streaming Deduplication"), then the windowed count of "Handling Late
Data and Watermarking", written to parquet. Two stateful operators in one stage."""

from changeover.runtime import Files, Stage
from pyspark.sql.functions import window
from pyspark.sql.types import StringType, StructField, StructType, TimestampType


def build(spark, ctx):
    events = (spark.readStream.schema(StructType([StructField("timestamp", TimestampType()),
                                                  StructField("word", StringType()),
                                                  StructField("id", StringType())]))
              .json(ctx.options["words"]))

    # Without the event time in the key, Spark would keep every id for ever; with it, the watermark ages them out.
    deduplicated = events \
        .withWatermark("timestamp", "10 seconds") \
        .dropDuplicates(["id", "timestamp"])

    windowedCounts = deduplicated \
        .groupBy(
            window("timestamp", "10 seconds", "5 seconds"),
            "word") \
        .count()

    return [Stage("deduplicated_counts", windowedCounts, Files(ctx.options["output"], "parquet"), "append")]
