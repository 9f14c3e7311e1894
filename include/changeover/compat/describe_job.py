"""Runs in a Spark runtime's Python: build a job's stages on a local session and print their plans as JSON.

Nothing is started: the stages' DataFrames are only analysed. Run by `changeover.compat.extract`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any

from changeover.runtime.contract import JobContext
from changeover.runtime.plan import describe_stages

MARKER = "CHANGEOVER-PLANS "


def job_arguments(description: str | None) -> argparse.ArgumentParser:
    """The arguments every runtime-side entry takes: the job, its module, its options and Spark confs."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--job", required=True)
    parser.add_argument("--module", required=True)
    parser.add_argument("--options", default="{}", help="the job's options as JSON")
    parser.add_argument("--conf", action="append", default=[], help="a Spark conf as key=value")
    return parser


def local_session(app_name: str, confs: list[str], master: str = "local[1]") -> Any:
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.master(master).appName(app_name)
    for pair in ["spark.ui.enabled=false", "spark.sql.session.timeZone=UTC", *confs]:
        key, _, value = pair.partition("=")
        builder = builder.config(key, value)
    return builder.getOrCreate()


def build_stages(spark: Any, args: argparse.Namespace) -> list[Any]:
    return importlib.import_module(args.module).build(spark, JobContext(args.job, 0, json.loads(args.options)))


def main(argv: list[str] | None = None) -> int:
    args = job_arguments(__doc__).parse_args(argv)
    spark = local_session(f"changeover-check-{args.job}", args.conf)
    try:
        print(MARKER + json.dumps(describe_stages(spark, build_stages(spark, args))), flush=True)
        return 0
    finally:
        spark.stop()


if __name__ == "__main__":
    sys.exit(main())
