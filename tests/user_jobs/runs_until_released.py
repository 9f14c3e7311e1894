"""An unchanged batch script, as a team submits it with spark-submit: it works until a file appears (named by its
Spark conf spark.changeover.test.release), then counts and ends. At most 300 s."""

import time
from pathlib import Path

from pyspark.sql import SparkSession

if __name__ == "__main__":
    spark = SparkSession.builder.getOrCreate()
    release = Path(spark.sparkContext.getConf().get("spark.changeover.test.release"))
    deadline = time.monotonic() + 300
    while not release.exists() and time.monotonic() < deadline:
        spark.range(100).count()
        time.sleep(0.5)
    spark.range(1000).count()
    spark.stop()
