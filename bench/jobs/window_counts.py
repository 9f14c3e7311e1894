"""The benchmark's query under Changeover: one stage, Spark's parquet file sink; with the option `stages` at 2, a
second stage of the same query into a folder of its own, a job of two queries as the demo's `clicks` is. The option
`trigger` overrides the bench's interval."""

from changeover.runtime import Files, Stage
from window_query import TRIGGER, stage_outputs, windowed_counts


def build(spark, ctx):  # type: ignore[no-untyped-def]
    trigger = ctx.options.get("trigger", TRIGGER)
    return [Stage(name, windowed_counts(spark, ctx.options["landing"]), Files(output, "parquet"), "append", trigger)
            for name, output in stage_outputs(ctx.options["output"], int(ctx.options.get("stages", 1))).items()]
