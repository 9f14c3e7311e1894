"""Runs in one Spark runtime's Python: write a stateful checkpoint, or resume one written by another version.

`create INPUT CHECKPOINT` writes part 0 of the input and processes it; `resume INPUT CHECKPOINT` adds part 1
and processes it from a copy of that checkpoint; `create-rocksdb` and `rescale` do the same on the RocksDB store,
with the copy's state repartitioned from 2 to 3 partitions before the resume (the file source's log names the
input by its absolute path, so the input stays where it was). Prints whether the result is exact. Used by
`changeover.compat.version_table`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

MARKER = "CHANGEOVER-RESUMED "
KEYS = ("k0", "k1", "k2")


def rows_of(part: int) -> list[dict[str, Any]]:
    """Both parts hit the same keys and windows, so the resumed counts need the saved state; part 1 adds
    new (key, n) pairs, so the deduplication emits exactly those."""
    return [{"key": KEYS[i % 3], "ts": f"2026-01-01T00:00:{i:02d}Z", "n": i % (4 if part == 0 else 6)}
            for i in range(24)]


def write_part(folder: Path, part: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"part-{part}.json").write_text("\n".join(json.dumps(r) for r in rows_of(part)) + "\n")


def expected() -> dict[str, Any]:
    """What the resumed run must emit, computed here, not by Spark: the latest count per key and per window
    over both parts, and the pairs only part 1 has."""
    totals: dict[str, int] = {}
    windows: dict[str, int] = {}
    for row in rows_of(0) + rows_of(1):
        totals[row["key"]] = totals.get(row["key"], 0) + 1
        window = f"{row['ts'][:18]}0|{row['key']}"  # 10 s tumbling windows
        windows[window] = windows.get(window, 0) + 1
    seen = {f"{r['key']}|{r['n']}" for r in rows_of(0)}
    return {"totals": totals, "windows": windows,
            "unique": sorted({f"{r['key']}|{r['n']}" for r in rows_of(1)} - seen)}


def resumed(outputs: dict[str, list[tuple[Any, ...]]]) -> dict[str, Any]:
    return {"totals": {k: v for k, v in outputs["totals"]}, "windows": {k: v for k, v in outputs["windows"]},
            "unique": sorted(r[0] for r in outputs["unique"])}


def stages(spark: Any, folder: Path) -> dict[str, tuple[Any, str]]:
    from pyspark.sql import functions as F

    events = spark.readStream.schema("key STRING, ts TIMESTAMP, n INT").json(str(folder))
    windows = events.groupBy(F.window("ts", "10 seconds"), "key").count().select(
        F.concat(F.date_format("window.start", "yyyy-MM-dd'T'HH:mm:ss"), F.lit("|"), "key").alias("k"), "count")
    return {"totals": (events.groupBy("key").count(), "update"), "windows": (windows, "update"),
            "unique": (events.dropDuplicates(["key", "n"]).select(F.concat("key", F.lit("|"), "n")), "append")}


ROCKSDB = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
RESCALED_TO = 3  # from the 2 partitions the checkpoint is written with


def run(folder: Path, checkpoint: Path, rocksdb: bool = False, rescale: bool = False) -> dict[str, Any]:
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false")
             .config("spark.sql.shuffle.partitions", "2").config("spark.sql.session.timeZone", "UTC").getOrCreate())
    if rocksdb:
        spark.conf.set("spark.sql.streaming.stateStore.providerClass", ROCKSDB)
    outputs: dict[str, Any] = {}
    for name, (frame, mode) in stages(spark, folder).items():
        if rescale:  # offline, on the stopped checkpoint (Spark 4.2+; fails here on older versions)
            spark.streams.active  # noqa: B018 - Spark 4.2.x: starts the state store coordinator the repartition needs
            spark._streamingCheckpointManager.repartition(str(checkpoint / name), RESCALED_TO)
        rows: list[tuple[Any, ...]] = []
        query = (frame.writeStream.outputMode(mode).option("checkpointLocation", str(checkpoint / name))
                 .foreachBatch(lambda batch, _id, rows=rows: rows.extend(tuple(r) for r in batch.collect()))
                 .trigger(availableNow=True).start())
        query.awaitTermination()
        outputs[name] = rows
    spark.stop()
    return outputs


def main(argv: list[str]) -> int:
    action, folder, checkpoint = argv[0], Path(argv[1]), Path(argv[2])
    if action in ("create", "create-rocksdb"):
        write_part(folder, 0)
        run(folder, checkpoint, rocksdb=action == "create-rocksdb")
        return 0
    write_part(folder, 1)
    outputs = run(folder, checkpoint, rescale=action == "rescale")
    got = resumed(outputs)
    print(MARKER + json.dumps({"exact": got == expected(), "got": got, "expected": expected()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
