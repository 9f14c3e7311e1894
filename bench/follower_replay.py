"""Can a read-only follower keep up with a live query by replaying its batches one at a time? (issue 27's question)

A live windowed count (file source, watermark, update mode, 1 s trigger) runs in a local Spark session while files
arrive every 0.5 s. Then a follower with a checkpoint of its own replays the live run's batches one by one: for each
batch it copies the file source's log entries and the batch's `offsets/N` (never `commits/`), and starts the same
query with `Trigger.Once`, which re-runs exactly that uncommitted batch with the logged offsets and watermark and
stops. Prints the live run's batch time beside the follower's time per replayed batch (query start, state reload and
the batch), their ratio, and whether the follower's output equals the live run's.

    .venv/bin/python bench/follower_replay.py [--batches 20]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F  # noqa: N812 - Spark's own convention


class Files:
    """JSON files of 50 events each, written whole (renamed into place), two per second once started."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.count = folder, 0
        folder.mkdir(parents=True)
        self._stop = threading.Event()

    def write(self) -> None:
        i, self.count = self.count, self.count + 1
        stamp = f"2026-01-01T00:{(i // 6) % 60:02d}:{(i * 10) % 60:02d}Z"
        partial = self.folder / f".{i}.partial"
        partial.write_text("\n".join(json.dumps({"key": f"k{j % 7}", "ts": stamp}) for j in range(50)))
        partial.rename(self.folder / f"{i:05d}.json")

    def start(self) -> None:
        threading.Thread(target=self._run, daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.write()


def counts(spark: SparkSession, source: Path) -> DataFrame:
    events = spark.readStream.schema("key string, ts timestamp").json(str(source))
    return events.withWatermark("ts", "30 seconds").groupBy(F.window("ts", "1 minute"), "key").count()


def collecting(into: dict[tuple[str, str], int]) -> Any:
    def write(batch: DataFrame, _batch_id: int) -> None:
        for row in batch.collect():
            into[(str(row["window"]["start"]), row["key"])] = row["count"]
    return write


def source_log_offset(checkpoint: Path, batch: int) -> int:
    """The file source's own log number that batch N read up to (not the batch id: only batches with new files
    advance it)."""
    if batch < 0:
        return -1
    line = (checkpoint / "offsets" / str(batch)).read_text().splitlines()[2]
    return int(json.loads(line)["logOffset"]) if line.startswith("{") else int(line)


def hand_batch(live: Path, follower: Path, batch: int) -> None:
    """One batch of the live run's logs into the follower's checkpoint: its source entries first, then its offsets."""
    for entry in range(source_log_offset(live, batch - 1) + 1, source_log_offset(live, batch) + 1):
        for name in (str(entry), f"{entry}.compact"):
            if (live / "sources" / "0" / name).exists():
                shutil.copy(live / "sources" / "0" / name, follower / "sources" / "0" / name)
    shutil.copy(live / "offsets" / str(batch), follower / "offsets" / str(batch))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=20)
    args = parser.parse_args()
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.sql.shuffle.partitions", "4").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    with tempfile.TemporaryDirectory(prefix="changeover-bench-follower-") as scratch:
        root = Path(scratch)
        files, live, follower = Files(root / "in"), root / "live", root / "follower"
        for _ in range(3):
            files.write()
        outputs: dict[str, dict[tuple[str, str], int]] = {"live": {}, "follower": {}}
        query = (counts(spark, files.folder).writeStream.outputMode("update")
                 .foreachBatch(collecting(outputs["live"])).option("checkpointLocation", str(live))
                 .trigger(processingTime="1 second").start())
        files.start()
        while (query.lastProgress or {}).get("batchId", -1) < args.batches:
            time.sleep(0.2)
        files.stop()
        query.stop()
        live_ms = [p["durationMs"]["triggerExecution"] for p in query.recentProgress if p["numInputRows"] > 0]
        last = max(int(p.name) for p in (live / "commits").iterdir() if p.name.isdigit())

        (follower / "offsets").mkdir(parents=True)
        (follower / "sources" / "0").mkdir(parents=True)
        shutil.copy(live / "metadata", follower / "metadata")  # the query's id: the same query, replayed
        replay_s = []
        for batch in range(last + 1):
            hand_batch(live, follower, batch)
            began = time.monotonic()
            (counts(spark, files.folder).writeStream.outputMode("update")
             .foreachBatch(collecting(outputs["follower"])).option("checkpointLocation", str(follower))
             .trigger(once=True).start().awaitTermination())
            replay_s.append(time.monotonic() - began)
        committed = sorted(int(p.name) for p in (follower / "commits").iterdir() if p.name.isdigit())
    spark.stop()
    live_median = statistics.median(live_ms) / 1000
    replay_median = statistics.median(replay_s)
    print(f"live run: {last + 1} batches, median batch {live_median:.2f} s (trigger interval 1 s)")
    print(f"follower: {len(committed)} batches replayed, per batch median {replay_median:.2f} s, "
          f"p90 {sorted(replay_s)[int(len(replay_s) * 0.9)]:.2f} s, max {max(replay_s):.2f} s")
    print(f"ratio follower/live per batch: {replay_median / live_median:.2f}")
    print(f"outputs equal: {outputs['live'] == outputs['follower']} ({len(outputs['live'])} window/key counts)")


if __name__ == "__main__":
    main()
