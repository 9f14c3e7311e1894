"""The windowed word count of Spark's Structured Streaming guide ("Handling Late Data and Watermarking"),
reading its words from JSON files and writing parquet. Changeover adds the stage name and the sink; the query
names its columns (see below), otherwise it is the guide's."""

from changeover.runtime import Files, Stage
from pyspark.sql.functions import window
from pyspark.sql.types import StringType, StructField, StructType, TimestampType


def build(spark, ctx):
    words = (spark.readStream.schema(StructType([StructField("timestamp", TimestampType()),
                                                 StructField("word", StringType())]))
             .json(ctx.options["words"]))

    # Group the data by window and word and compute the count of each group. The guide writes
    # window(words.timestamp, ...), words.word: those name the columns before withWatermark, and on Spark
    # 4.2.0 and 4.3.0 alike (checked without Changeover) append mode is then refused as "aggregations without
    # watermark". Naming the columns is the one change.
    windowedCounts = words \
        .withWatermark("timestamp", "10 seconds") \
        .groupBy(
            window("timestamp", "10 seconds", "5 seconds"),
            "word") \
        .count()

    return [Stage("windowed_counts", windowedCounts, Files(ctx.options["output"], "parquet"), "append")]
