"""The benchmark's query as a bare PySpark script: started, then stopped when a stop file appears.

Its settings come from bench-bare.json under CHANGEOVER_HOME; it writes how long `query.stop()` took."""

import json
import os
import time
from pathlib import Path

from pyspark.sql import SparkSession
from window_query import TRIGGER, windowed_counts

if __name__ == "__main__":
    config = json.loads((Path(os.environ["CHANGEOVER_HOME"]) / "bench-bare.json").read_text())
    spark = SparkSession.builder.getOrCreate()
    query = (windowed_counts(spark, config["landing"]).writeStream.format("parquet")
             .option("path", config["output"]).option("checkpointLocation", config["checkpoint"])
             .outputMode("append").trigger(processingTime=TRIGGER).start())
    stop_file = Path(config["stop_file"])
    while not stop_file.exists():
        time.sleep(0.05)
    started = time.perf_counter()
    query.stop()
    Path(config["stopped_file"]).write_text(str(time.perf_counter() - started))
