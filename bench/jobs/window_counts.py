"""The benchmark's query under Changeover: one stage, Spark's parquet file sink."""

from changeover.runtime import Files, Stage
from window_query import TRIGGER, windowed_counts


def build(spark, ctx):  # type: ignore[no-untyped-def]
    counts = windowed_counts(spark, ctx.options["landing"])
    return [Stage("counts", counts, Files(ctx.options["output"], "parquet"), "append", TRIGGER)]
