"""A keyed-table batch of 1,000,000 rows: rows per second, and the driver's peak memory against collecting it.

Each measurement runs in a fresh process with a local Spark session (local[2], 4 partitions): the keyed table's
write (executors stage their partitions in chunks, the driver merges in one transaction), and as the baseline the
same rows collected on the driver, as the old (string, long) sink did. Peak memory is the driver process's
maximum resident set (Python) and the JVM's peak heap, read from the JVM's own memory pools.

    .venv/bin/python bench/keyed_table_batch.py [--rows 1000000] [--database-url URL]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from changeover import shipping
from changeover.registry.db import session_scope
from changeover.registry.models import Job, JobRun
from changeover.registry.schema import migrate
from changeover.runtime import KeyedTable
from changeover.runtime.sinks import WriteContext
from changeover.settings import CHECKOUT, Settings


def jvm_peak_heap(spark) -> int:  # type: ignore[no-untyped-def]
    pools = spark._jvm.java.lang.management.ManagementFactory.getMemoryPoolMXBeans()
    return sum(p.getPeakUsage().getUsed() for p in pools if str(p.getType().toString()).split()[0].lower() == "heap")


def one(mode: str, rows: int, url: str, home: Path) -> dict[str, float]:
    from pyspark.sql import SparkSession

    package, _entry = shipping.runtime_artifacts(Settings.from_env(home=home))
    os.environ["PYSPARK_PYTHON"] = sys.executable
    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.driver.memory", "1g").config("spark.submit.pyFiles", str(package)).getOrCreate())
    frame = spark.range(rows, numPartitions=4).selectExpr("concat('key-', id) AS key", "id AS total",
                                                          "id % 97 AS bucket")
    started = time.perf_counter()
    if mode == "collect":
        collected = [(r[0], r[1], r[2]) for r in frame.collect()]
        assert len(collected) == rows
    else:
        with session_scope(url) as s:
            s.add(Job(name="bench", module="m", fault_tolerant=True, block_shutdown=False, options={}))
            s.flush()
            run = JobRun(job="bench", spark_version=spark.version, master_url="local", state="RUNNING", progress={})
            s.add(run)
            s.flush()
            s.get(Job, "bench").current_run_id = run_id = run.id
        sink = KeyedTable(url, "bench_rows", keys=("key",))
        assert sink.write(frame, 0, WriteContext(url, "bench", "rows", run_id))
    elapsed = time.perf_counter() - started
    heap = jvm_peak_heap(spark)
    spark.stop()
    return {"seconds": elapsed, "python_peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "jvm_peak_heap": heap}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--database-url")
    parser.add_argument("--mode", choices=("keyed", "collect"), help=argparse.SUPPRESS)
    parser.add_argument("--home", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        print("RESULT " + json.dumps(one(args.mode, args.rows, args.database_url, Path(args.home))), flush=True)
        return
    base = CHECKOUT / ".changeover" / "bench"
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="keyed-", dir=base))
    url = args.database_url or f"sqlite:///{work / 'sink.db'}"
    migrate(url)
    results = {}
    for mode in ("collect", "keyed"):
        out = subprocess.run([sys.executable, __file__, "--mode", mode, "--rows", str(args.rows), "--database-url",
                              url, "--home", str(work / "home")], capture_output=True, text=True, check=True)
        line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
        results[mode] = json.loads(line.removeprefix("RESULT "))
    keyed, collect = results["keyed"], results["collect"]
    print(f"{args.rows:,} rows into a keyed table on {url.split(':')[0]}")
    print(f"  keyed-table write: {keyed['seconds']:.1f} s, {args.rows / keyed['seconds']:,.0f} rows/s")
    for name, label in (("python_peak_rss", "driver Python peak RSS"), ("jvm_peak_heap", "driver JVM peak heap")):
        print(f"  {label}: {keyed[name] / 2**20:,.0f} MiB writing vs {collect[name] / 2**20:,.0f} MiB collecting "
              f"(ratio {keyed[name] / collect[name]:.2f})")


if __name__ == "__main__":
    main()
