"""A stage checkpoint's state partitions: read from its offset log, and changed offline on a stopped checkpoint.

Spark pins `spark.sql.shuffle.partitions` and the state store provider in every offset log entry's metadata,
so a stateful stage keeps the count of its first run. From Spark 4.2, `StreamingCheckpointManager.repartition`
rewrites the state of a stopped checkpoint (RocksDB provider only) as one extra committed batch, N+1, that reads
no input. Changeover runs it only on a run's own checkpoint, laid out from a savepoint, never on the savepoint.

A batch Spark had planned but not committed (offsets N+1 without commits/N+1) would block the repartition, and its
offsets must still be replayed so the sinks see that input once: it is set aside first, and written back after the
repartition's batch under the next id, with the new count, so the first batch of the resumed run reads exactly it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from changeover import faults
from changeover.errors import ChangeoverError
from changeover.runtime import checkpoints

PARTITIONS = "spark.sql.shuffle.partitions"
PROVIDER = "spark.sql.streaming.stateStore.providerClass"
ROCKSDB = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
HDFS = "org.apache.spark.sql.execution.streaming.state.HDFSBackedStateStoreProvider"
SET_ASIDE = checkpoints.SET_ASIDE
RESCALING = ".rescaling"  # in a run's checkpoint root while its driver repartitions: no savepoint is taken of it


STATE_STORES = {"hdfs": HDFS, "rocksdb": ROCKSDB}  # the job option state_store


def state_store_confs(options: dict[str, Any]) -> dict[str, str]:
    """The state store a job's option `state_store` asks for. Spark pins it in the offset log at a stage's first
    batch, so it decides for good whether the stage's state can be repartitioned later (RocksDB only)."""
    store = options.get("state_store")
    if store is None:
        return {}
    if store not in STATE_STORES:
        raise ChangeoverError(f"job option state_store {store!r}", f"Changeover knows {', '.join(STATE_STORES)}",
                              "use rocksdb for a job whose state may need other partitions later, or leave it out "
                              "for Spark's default store (hdfs)")
    return {PROVIDER: STATE_STORES[store]}


def batch_conf(stage: Path, batch: int) -> dict[str, str]:
    """The session confs Spark pinned in a batch's offset log entry (empty when the batch has no entry)."""
    lines = checkpoints.offset_entry(stage, batch)
    return dict(json.loads(lines[1]).get("conf") or {}) if len(lines) > 1 else {}


def partitions(stage: Path, batch: int | None = None) -> int | None:
    """The state partitions of a stage as of `batch` (default: its last commit); None before its first commit."""
    batch = checkpoints.last_commit(stage) if batch is None else batch
    value = batch_conf(stage, batch).get(PARTITIONS) if batch is not None else None
    return int(value) if value else None


def provider(stage: Path) -> str | None:
    """The state store provider the stage's offset log pins; Spark's default (HDFS-backed) when it names none."""
    batch = checkpoints.last_commit(stage)
    if batch is None:
        return None
    return batch_conf(stage, batch).get(PROVIDER, HDFS)


def is_repartition(stage: Path, batch: int) -> bool:
    """Whether `batch` is a repartition's own: committed with another count than the batch before, from the same
    source offsets, so it read no input and no sink ever gets it."""
    if batch < 1 or not (stage / "commits" / str(batch)).exists():
        return False
    before, after = partitions(stage, batch - 1), partitions(stage, batch)
    return before is not None and after is not None and before != after and \
        checkpoints.source_offsets(stage, batch) == checkpoints.source_offsets(stage, batch - 1)


def has_state(stage: Path) -> bool:
    return (stage / "state").is_dir() and any(p.name.isdigit() for p in (stage / "state").iterdir())


def _write(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.rescale.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)  # whole or not there: Spark never reads half an entry


def _with_partitions(entry: str, count: int) -> str:
    lines = entry.splitlines()
    metadata: dict[str, Any] = json.loads(lines[1])
    metadata.setdefault("conf", {})[PARTITIONS] = str(count)
    return "\n".join([lines[0], json.dumps(metadata, separators=(",", ":")), *lines[2:]])


def set_pending_aside(stage: Path, last: int) -> None:
    """Move the planned, uncommitted batch after `last` out of the log (kept beside it until written back). A
    planned batch with another count than the last commit is a repartition Spark left unfinished: Spark retries it
    itself, so it stays. Repeated after a crash, a batch already set aside stays as it was."""
    planned, aside = stage / "offsets" / str(last + 1), stage / SET_ASIDE
    if aside.exists() or not planned.exists() or partitions(stage, last + 1) != partitions(stage, last):
        return
    _write(aside, json.dumps({"after": last, "entry": planned.read_text()}))
    planned.with_name(f".{planned.name}.crc").unlink(missing_ok=True)
    planned.unlink()  # a hard link of the savepoint's file, or a copy: the savepoint keeps its own


def set_aside_entry(stage: Path) -> list[str]:
    """The planned batch's offset log entry while it is set aside, by line; empty when none is."""
    aside = stage / SET_ASIDE
    return json.loads(aside.read_text())["entry"].splitlines() if aside.exists() else []


def put_pending_back(stage: Path, count: int) -> int | None:
    """Write the set-aside offsets as the batch after the repartition's, with the new count. Returns its id. Only
    right after the repartition's own batch, which follows the batch it was planned after; anything else is refused
    rather than replaying old input."""
    aside = stage / SET_ASIDE
    if not aside.exists():
        return None
    saved = json.loads(aside.read_text())
    last = checkpoints.last_commit(stage)
    if last != saved["after"] + 1 or not is_repartition(stage, last):
        raise ChangeoverError(f"stage checkpoint {stage}", f"its planned batch was set aside after batch "
                              f"{saved['after']} for a repartition, but its last commit is {last}, not that "
                              "repartition's own batch", "resume the job from its savepoint; this checkpoint is "
                              "not used again")
    target = stage / "offsets" / str(last + 1)
    if not target.exists():
        _write(target, _with_partitions(saved["entry"], count))
    aside.unlink()
    return last + 1


def rescale(spark: Any, stage: Path, count: int) -> tuple[int, int] | None:
    """Repartition one stopped stage checkpoint's state to `count` partitions, on the session's Spark. Returns
    (the old count, the repartition's batch), or None when there is nothing to do: no state, or the count already.
    Safe to repeat on the same folder after a crash at any point."""
    last = checkpoints.last_commit(stage)
    before = partitions(stage, last)
    if last is None or before is None or not has_state(stage):
        return None
    if before == count:
        put_pending_back(stage, count)  # a crash after the repartition, before the write-back
        return None
    set_pending_aside(stage, last)
    spark.streams.active  # noqa: B018 - on 4.2.x the repartition needs the state store coordinator this starts
    spark._streamingCheckpointManager.repartition(str(stage), count)  # noqa: SLF001 - Spark 4.2's experimental API
    batch = checkpoints.last_commit(stage)
    faults.reached_in_job("rescale.repartitioned", stage.name)
    put_pending_back(stage, count)
    assert batch is not None
    return before, batch
