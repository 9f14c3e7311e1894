"""A keyed-table batch of 1,000,000 rows: staging through COPY against executemany, rows per second of the whole
write, and the driver's peak memory against collecting it.

Staging: one partition's rows into the staging table as an executor stages them, by `COPY` and, as the baseline
beside it, by batched inserts (SQLAlchemy's executemany), on the same database in the same run; PostgreSQL only
(SQLite has no COPY), from --database-url or CHANGEOVER_TEST_DATABASE_URL.

Each measurement runs in a fresh process with a local Spark session (local[2], 4 partitions): the keyed table's
write (executors stage their partitions in chunks, the driver merges in one transaction), and as the baseline the
same rows collected on the driver, as the old (string, long) sink did. Peak memory is the driver process's
maximum resident set (Python) and the JVM's peak heap, read from the JVM's own memory pools.

    .venv/bin/python bench/keyed_table_batch.py [--rows 1000000] [--database-url postgresql+psycopg://...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from changeover.cluster import shipping
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


def staging(rows: int, url: str) -> dict[str, float]:
    """Seconds to stage `rows` rows by COPY and by executemany, each into a fresh staging table."""
    import sqlalchemy as sa
    from changeover.registry.db import engine_for
    from changeover.runtime.sinks.keyed_table import stage_rows

    seconds = {}
    for name, use_copy in (("executemany", False), ("copy", True)):
        staging = f"bench_stage_{name}"
        with engine_for(url).begin() as connection:
            connection.execute(sa.text(f"DROP TABLE IF EXISTS {staging}"))
            connection.execute(sa.text(
                f"CREATE TABLE {staging} (key TEXT, total BIGINT, bucket BIGINT, _co_owner VARCHAR(200), "
                "_co_batch BIGINT, _co_run BIGINT, _co_part INTEGER, _co_attempt BIGINT)"))
        generated = ((f"key-{i}", i, i % 97) for i in range(rows))
        started = time.perf_counter()
        stage_rows(url, staging, ["key", "total", "bucket"], "bench/rows", 0, 1, 10_000, 0, 1, generated,
                   use_copy=use_copy)
        seconds[name] = time.perf_counter() - started
        with engine_for(url).begin() as connection:
            assert connection.scalar(sa.text(f"SELECT count(*) FROM {staging}")) == rows
            connection.execute(sa.text(f"DROP TABLE {staging}"))
    return seconds


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
    postgres = args.database_url or os.environ.get("CHANGEOVER_TEST_DATABASE_URL", "")
    if postgres.startswith("postgresql"):
        staged = staging(args.rows, postgres)
        print(f"{args.rows:,} rows staged into PostgreSQL by one partition")
        for name in ("executemany", "copy"):
            print(f"  {name}: {staged[name]:.1f} s, {args.rows / staged[name]:,.0f} rows/s")
        print(f"  COPY / executemany rows/s: {staged['executemany'] / staged['copy']:.1f}x")
    else:
        print("staging: skipped, COPY needs PostgreSQL (--database-url or CHANGEOVER_TEST_DATABASE_URL)")
    base = CHECKOUT / ".changeover" / "bench"
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="keyed-", dir=base))
    with scratch_database(postgres, work) as url:
        write(args.rows, url, work)


@contextlib.contextmanager
def scratch_database(postgres: str, work: Path) -> Iterator[str]:
    """A fresh PostgreSQL database on that server, dropped after; SQLite in the work folder without one."""
    import sqlalchemy as sa

    if not postgres.startswith("postgresql"):
        yield f"sqlite:///{work / 'sink.db'}"
        return
    name = f"changeover_bench_{os.getpid()}"
    admin = sa.create_engine(postgres, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield sa.make_url(postgres).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as connection:
            connection.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def write(rows: int, url: str, work: Path) -> None:
    migrate(url)
    results = {}
    for mode in ("collect", "keyed"):
        out = subprocess.run([sys.executable, __file__, "--mode", mode, "--rows", str(rows), "--database-url",
                              url, "--home", str(work / "home")], capture_output=True, text=True, check=True)
        line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
        results[mode] = json.loads(line.removeprefix("RESULT "))
    keyed, collect = results["keyed"], results["collect"]
    print(f"{rows:,} rows into a keyed table on {url.split(':')[0]}")
    print(f"  keyed-table write: {keyed['seconds']:.1f} s, {rows / keyed['seconds']:,.0f} rows/s")
    for name, label in (("python_peak_rss", "driver Python peak RSS"), ("jvm_peak_heap", "driver JVM peak heap")):
        print(f"  {label}: {keyed[name] / 2**20:,.0f} MiB writing vs {collect[name] / 2**20:,.0f} MiB collecting "
              f"(ratio {keyed[name] / collect[name]:.2f})")


if __name__ == "__main__":
    main()
