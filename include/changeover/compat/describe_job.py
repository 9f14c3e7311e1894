"""Runs in a Spark runtime's Python: build a job's stages on a local session and print their plans as JSON.

Nothing is started: the stages' DataFrames are only analysed. Run by `changeover.compat.extract`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from changeover.compat.plan import describe_stages
from changeover.runtime.contract import JobContext

MARKER = "CHANGEOVER-PLANS "


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job", required=True)
    parser.add_argument("--module", required=True)
    parser.add_argument("--options", default="{}", help="the job's options as JSON")
    parser.add_argument("--conf", action="append", default=[], help="a Spark conf as key=value")
    args = parser.parse_args(argv)
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.master("local[1]").appName(f"changeover-check-{args.job}")
    for pair in ["spark.ui.enabled=false", "spark.sql.session.timeZone=UTC", *args.conf]:
        key, _, value = pair.partition("=")
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    try:
        stages = importlib.import_module(args.module).build(spark, JobContext(args.job, 0, json.loads(args.options)))
        print(MARKER + json.dumps(describe_stages(spark, stages)), flush=True)
        return 0
    finally:
        spark.stop()


if __name__ == "__main__":
    sys.exit(main())
