"""The benchmark's query, shared by its bare and its Changeover form: 10 s windowed counts of click events."""

from pyspark.sql import functions as F
from pyspark.sql.types import LongType, StringType, StructField, StructType, TimestampType

SCHEMA = StructType([StructField("key", StringType()), StructField("ts", TimestampType()),
                     StructField("seq", LongType())])
TRIGGER = "1 second"


def windowed_counts(spark, landing):  # type: ignore[no-untyped-def]
    events = spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 20).json(landing)
    return events.withWatermark("ts", "10 seconds").groupBy(F.window("ts", "10 seconds"), "key").count()


def stage_outputs(output: str, stages: int) -> dict[str, str]:
    """Each stage's name and output folder under Changeover: counts into `output`, counts_2 into `output`_2, ..."""
    return {"counts" if n == 1 else f"counts_{n}": output if n == 1 else f"{output}_{n}" for n in range(1, stages + 1)}
