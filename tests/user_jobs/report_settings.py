"""An unchanged batch script: it writes down the Spark settings it was launched with, then ends."""

import json
import os

from pyspark.sql import SparkSession

if __name__ == "__main__":
    spark = SparkSession.builder.getOrCreate()
    conf = spark.sparkContext.getConf()
    keys = ["spark.executor.cores", "spark.executor.memory", "spark.cores.max", "spark.sql.shuffle.partitions",
            "spark.changeover.test.marker", "spark.jars"]
    found = {key: conf.get(key, None) for key in keys}
    found["counted"] = spark.range(1000).count()
    with open(os.path.join(os.environ["CHANGEOVER_HOME"], "report_settings.json"), "w") as out:
        json.dump(found, out)
