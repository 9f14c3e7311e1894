"""A member's Spark Connect server: the coordinator of the light jobs routed to the member.

It is a Spark application of the member's version group, its driver on the member's host and its executors
placed by the group's master, so a light job runs on one version only. It is small on purpose: one executor
core, so light SQL never starves the streaming jobs of the group.
"""

from __future__ import annotations

from pathlib import Path

CONNECT_SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
CONNECT_CONFS = {
    "spark.cores.max": "1",
    "spark.executor.cores": "1",
    "spark.executor.memory": "512m",
    "spark.driver.memory": "768m",
    "spark.ui.enabled": "false",
    "spark.decommission.enabled": "true",  # its executor on a draining member leaves, and comes back elsewhere
    "spark.sql.session.timeZone": "UTC",
    # light jobs are small by definition: Spark's 200 shuffle partitions are 200 tasks on one core per aggregation
    # (a session may set more for itself)
    "spark.sql.shuffle.partitions": "2",
    # Adaptive execution re-plans each query stage by stage after its shuffles, which costs a light job more than it
    # saves on data this small (a session may turn it back on for a large query)
    "spark.sql.adaptive.enabled": "false",
}


def command(spark_class: Path, master_url: str, host: str, port: int, member: str) -> list[str]:
    """spark-submit of Spark's own Connect server, bound to the member's address."""
    confs = {**CONNECT_CONFS, "spark.connect.grpc.binding.address": host, "spark.connect.grpc.binding.port": str(port),
             "spark.driver.host": host, "spark.driver.bindAddress": host}
    args = [str(spark_class), "org.apache.spark.deploy.SparkSubmit", "--class", CONNECT_SERVER_CLASS,
            "--master", master_url, "--name", f"changeover-connect-{member}"]
    for key, value in confs.items():
        args += ["--conf", f"{key}={value}"]
    return [*args, "spark-internal"]


def address(host: str, port: int) -> str:
    return f"sc://{host}:{port}"
