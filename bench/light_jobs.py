"""A routed light job's round trip against `spark-submit` of the same work, in the same run.

Starts a two-member local cluster with a Spark Connect server per member, then times:
  - the routed light job with a pooled session (`changeover.light.session(reuse=True)`): routing, the version
    check, the ledger's start and end rows, and the query;
  - the same with a new session per job (what `changeover sql --no-agent` does, once);
  - `spark-submit` of an application that runs the same SQL on the same group's master.
The work is `SELECT sum(id) FROM range(1000)`. Prints p50 and p95 of each, and the ratios.

    .venv/bin/python bench/light_jobs.py [--jobs 40] [--submits 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time

from changeover import light
from changeover.cluster import membership_for
from changeover.cluster.runtimes import find_runtime, java_home
from scratch import scratch_settings

SQL = "SELECT sum(id) AS total FROM range(1000)"
APP = f"""
from pyspark.sql import SparkSession
spark = SparkSession.builder.getOrCreate()
assert spark.sql("{SQL}").collect()[0][0] == 499500
spark.stop()
"""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def light_round_trips(settings: object, jobs: int, reuse: bool) -> list[float]:
    times = []
    for _ in range(jobs):
        began = time.perf_counter()
        with light.session(settings, statement=SQL, reuse=reuse) as job:  # type: ignore[arg-type]
            assert job.spark.sql(SQL).collect()[0][0] == 499500
        times.append(time.perf_counter() - began)
    return times


def submit_round_trips(settings: object, master_url: str, submits: int) -> list[float]:
    runtime = find_runtime(settings.runtimes_dir, "4.2.0")  # type: ignore[attr-defined]
    app = settings.home / "bench-app.py"  # type: ignore[attr-defined]
    app.write_text(APP)
    env = {**os.environ, "SPARK_HOME": str(runtime.spark_home), "JAVA_HOME": str(java_home()),
           "PYSPARK_PYTHON": str(runtime.python)}
    times = []
    for _ in range(submits):
        began = time.perf_counter()
        subprocess.run([str(runtime.spark_home / "bin" / "spark-submit"), "--master", master_url,
                        "--conf", "spark.ui.enabled=false", "--conf", "spark.cores.max=1", str(app)],
                       env=env, check=True, capture_output=True, timeout=300)
        times.append(time.perf_counter() - began)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=40)
    parser.add_argument("--submits", type=int, default=3)
    args = parser.parse_args()
    settings, _work = scratch_settings("light")
    cluster = membership_for(settings)
    try:
        cluster.up([("m1", "4.2.0"), ("m2", "4.2.0")], light_jobs=True)
        light_round_trips(settings, 4, reuse=True)  # warm both servers' executors and plans
        pooled = light_round_trips(settings, args.jobs, reuse=True)
        fresh = light_round_trips(settings, max(5, args.jobs // 4), reuse=False)
        master_url = next(m["url"] for m in cluster.status()["masters"] if m["version"] == "4.2.0")
        submitted = submit_round_trips(settings, master_url, args.submits)
    finally:
        cluster.down()
    rows = [("light job, pooled session", pooled), ("light job, new session", fresh),
            ("spark-submit", submitted)]
    print(f"{'':28} {'n':>4} {'p50 ms':>9} {'p95 ms':>9}")
    for name, times in rows:
        print(f"{name:28} {len(times):>4} {1000 * statistics.median(times):>9.0f} "
              f"{1000 * percentile(times, 0.95):>9.0f}")
    base = statistics.median(submitted)
    print(f"spark-submit / pooled light job (p50): {base / statistics.median(pooled):.0f}x; "
          f"/ new-session light job: {base / statistics.median(fresh):.0f}x")


if __name__ == "__main__":
    main()
