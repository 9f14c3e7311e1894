"""Why groups are keyed by the exact version: a 4.2.1 worker fails tasks of a 4.2.0 driver."""

import os
import subprocess
from pathlib import Path

import pytest
from changeover.cluster import LocalCluster, processes, routing, wait_for
from changeover.cluster.ports import free_port
from changeover.cluster.runtimes import find_runtime, java_home
from changeover.settings import Settings

pytestmark = pytest.mark.slow

APP = """
from pyspark.sql import SparkSession
spark = SparkSession.builder.getOrCreate()
print("SUM", spark.range(10).selectExpr("sum(id)").collect()[0][0])
"""


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_patch_version_mismatch_fails_tasks_so_groups_use_the_exact_version(
    settings: Settings, cluster: LocalCluster, tmp_path: Path
) -> None:
    master_row = cluster.ensure_master("4.2.0")
    master = cluster.master("4.2.0")
    # Deliberately wrong: a 4.2.1 worker registered with the 4.2.0 master, bypassing Changeover's grouping.
    stray_runtime = find_runtime(settings.runtimes_dir, "4.2.1")
    stray = processes.spawn(
        [str(stray_runtime.spark_class), "org.apache.spark.deploy.worker.Worker", "--host", "127.0.2.1",
         "--cores", "1", "--memory", "1g", "--webui-port", str(free_port()), "--work-dir", str(tmp_path / "w"),
         master_row.url],
        {**os.environ, "SPARK_HOME": str(stray_runtime.spark_home), "JAVA_HOME": str(java_home())},
        tmp_path / "stray-worker.log",
    )
    try:
        wait_for(lambda: master.worker_state("127.0.2.1") == "ALIVE", 60, "the stray worker registering")
        app = tmp_path / "app.py"
        app.write_text(APP)
        runtime = find_runtime(settings.runtimes_dir, "4.2.0")
        result = subprocess.run(
            [str(runtime.spark_home / "bin" / "spark-submit"), "--master", master_row.url,
             "--conf", "spark.task.maxFailures=1", "--conf", "spark.ui.enabled=false",
             "--conf", f"spark.pyspark.python={runtime.python}", str(app)],
            env={**os.environ, "SPARK_HOME": str(runtime.spark_home), "JAVA_HOME": str(java_home()),
                 "PYSPARK_PYTHON": str(runtime.python)},
            capture_output=True, text=True, timeout=300,
        )
        assert result.returncode != 0 and "SUM 45" not in result.stdout
        assert "InvalidClassException" in result.stderr
    finally:
        processes.stop_group(stray.pid, stray.start_ticks)

    # Changeover's own placement: a 4.2.1 member gets its own group and master.
    cluster.up([("a", "4.2.0"), ("b", "4.2.1")])
    assert routing.version_groups(settings) == {"4.2.0": ["a"], "4.2.1": ["b"]}
    masters = {m["version"]: m["url"] for m in cluster.status()["masters"] if m["running"]}
    assert set(masters) == {"4.2.0", "4.2.1"} and masters["4.2.0"] != masters["4.2.1"]
