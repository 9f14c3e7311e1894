"""Files (parquet, json, csv, ...) under a folder, listed by the `_spark_metadata` log that Spark's file sink
keeps and Spark's reader trusts: a file the log does not list is never read.

Each micro-batch is written by Spark's batch writer into a staging folder, then committed inside the fence: its
files are moved into place and the batch's log entry is added by Spark's own `FileStreamSinkLog`. A superseded run
never lands a batch in the log, and what it staged or moved without logging is never read. The log makes the sink
exactly-once: a batch id already in it is skipped. That is also its trap: restored to an older savepoint, the query
replays batches the log has. So a savepoint keeps the log as of its batch, and a rewind deletes the data files that
later entries added and puts that log back.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import unquote, urlparse

from changeover import faults
from changeover.errors import ChangeoverError
from changeover.runtime import checkpoints, state_partitions
from changeover.runtime.sinks.base import Sink, WriteContext, foreach_batch, run_without_writing

FORMATS = ("parquet", "json", "csv", "orc", "text")
LOG = "_spark_metadata"
STAGING = "_changeover_staging"  # "_": hidden from Spark's reader, with or without the log
BATCHES = "_changeover_batches"  # <batch>.run<id>: which run committed each batch, from which source offsets


def written_name(run_id: int, name: str) -> str:
    """A committed data file's name: it says which run wrote it, to whoever lists the folder."""
    return f"run{run_id}-{name}"


def _log_batch(name: str) -> int | None:
    number = name.removesuffix(".compact")
    return int(number) if number.isdigit() else None


def log_entries(log: Path) -> set[str]:
    """Local paths of the data files a `_spark_metadata` log lists as added (compacted files included)."""
    added: set[str] = set()
    deleted: set[str] = set()
    for file in sorted(log.iterdir(), key=lambda p: _log_batch(p.name) or -1) if log.is_dir() else []:
        if _log_batch(file.name) is None:
            continue
        for line in file.read_text().splitlines()[1:]:
            if not line.strip():
                continue
            entry = json.loads(line)
            path = unquote(urlparse(entry["path"]).path)
            (deleted if entry.get("action") == "delete" else added).add(path)
    return added - deleted


@dataclass(frozen=True)
class Files(Sink):
    path: str
    format: str = "parquet"
    partition_by: tuple[str, ...] = ()
    options: dict[str, str] = field(default_factory=dict)
    kind: ClassVar[str] = "files"
    output_modes: ClassVar[tuple[str, ...]] = ("append",)  # as Spark's own file sink: files are never rewritten
    guarantee: str = "exactly-once"

    def __post_init__(self) -> None:
        scheme = urlparse(self.path).scheme
        if scheme not in ("", "file"):
            raise ChangeoverError(f"file sink path {self.path}", "Changeover reads and trims the sink's "
                                  "_spark_metadata log itself, and only on a local or mounted filesystem so far",
                                  "write to a local or mounted path (e.g. an NFS or FUSE mount of the bucket)")
        if self.format not in FORMATS:
            raise ChangeoverError(f"file sink format {self.format!r}", f"Spark's file sink writes {', '.join(FORMATS)}",
                                  "pick one of those")

    @property
    def root(self) -> Path:
        return Path(urlparse(self.path).path if self.path.startswith("file:") else self.path)

    @property
    def log(self) -> Path:
        return self.root / LOG

    def attach(self, frame: Any, context: WriteContext) -> Any:
        return foreach_batch(frame, context, functools.partial(self.write, context=context))

    def write(self, batch: Any, batch_id: int, context: WriteContext) -> bool:
        """Write one micro-batch; False when the log has it already (a replay). Staged by this call alone (a
        folder of its own), then committed inside the fence, waiting out a registry that does not answer."""
        if batch_id <= _or_before(self.progress(context)):
            self._require_same_replay(context, batch_id)
            run_without_writing(batch)
            return False
        staging = self.root / STAGING / f"run{context.run_id}-batch{batch_id}-{uuid.uuid4().hex[:12]}"
        try:
            writer = batch.write.format(self.format).options(**self.options)
            (writer.partitionBy(*self.partition_by) if self.partition_by else writer).save(str(staging))
            staged = sorted(str(p.relative_to(staging)) for p in staging.rglob("*")
                            if p.is_file() and not p.name.startswith(("_", ".")))
            return context.patiently(
                functools.partial(self._commit, batch.sparkSession, context, batch_id, staging, staged),
                f"job {context.job} stage {context.stage} batch {batch_id}: the registry")
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _commit(self, spark: Any, context: WriteContext, batch_id: int, staging: Path, staged: list[str]) -> bool:
        """Move the staged files into place and add the batch's log entry, under the job row's lock. Safe to
        repeat: a file already moved stays moved, and a batch the log has is not added again."""
        with context.hold(batch_id) as held:
            if batch_id <= _or_before(self.progress(context)):
                return False
            placed = []
            for relative in staged:
                folder, name = os.path.split(relative)
                target = self.root / folder / written_name(context.run_id, name)
                for source, moved in ((staging / folder / f".{name}.crc", target.with_name(f".{target.name}.crc")),
                                      (staging / relative, target)):  # Hadoop's checksum first: it is read first
                    if source.exists():
                        moved.parent.mkdir(parents=True, exist_ok=True)
                        source.replace(moved)
                placed.append(target)
            faults.reached_in_job("files.placed")  # in place, not yet in the log: never read
            gaps = self._repartitions_before(context, batch_id)
            self._record(context, batch_id)
            held.confirm()
            for gap in gaps:
                _add_to_log(spark, self.log, gap, [])
            _add_to_log(spark, self.log, batch_id, placed)
            return True

    def _repartitions_before(self, context: WriteContext, batch_id: int) -> list[int]:
        """The batch ids between the log's last entry and this batch, each a repartition's own (`--state-partitions`:
        a batch that reads no input and is never written). Spark's sink log compacts only an unbroken run of
        entries, so each gets an empty one; recorded first, like any batch. Any other gap is a lost batch: refused."""
        last = self.progress(context)
        if last is None or batch_id <= last + 1:
            return []
        gaps = list(range(last + 1, batch_id))
        stage = Path(context.checkpoint) if context.checkpoint else None
        lost = [gap for gap in gaps if stage is None or not state_partitions.is_repartition(stage, gap)]
        if lost:
            raise ChangeoverError(f"batch {batch_id} of job {context.job} stage {context.stage} into {self.root}",
                                  f"the sink's log ends at batch {last}, and batches {lost} are neither in it nor a "
                                  "repartition of the state: their rows would be missing",
                                  "resume the job from a savepoint at or before that batch with --rewind-sink")
        for gap in gaps:
            self._record(context, gap)
        return gaps

    def _record(self, context: WriteContext, batch_id: int) -> None:
        """Which run commits this batch, from which offsets: written before the log entry, so a batch the log has
        always has its record (an empty batch lists no file to tell its writer by)."""
        records = self.root / BATCHES
        records.mkdir(parents=True, exist_ok=True)
        for earlier in records.glob(f"{batch_id}.run*"):  # a batch id written again after a rewind
            earlier.unlink()
        written = records / f".{batch_id}.run{context.run_id}.writing"
        written.write_text(json.dumps({"sources": _source_offsets(context, batch_id)}))
        written.replace(records / f"{batch_id}.run{context.run_id}")

    def _require_same_replay(self, context: WriteContext, batch_id: int) -> None:
        """A batch id the log has is skipped only when it is the same batch: planned from the same source offsets.
        Planned from others (a run that resumed where another run had written, past its own plans), skipping it
        would lose its rows, so the job fails instead, saying how to go on."""
        ours = _source_offsets(context, batch_id)
        for record in (self.root / BATCHES).glob(f"{batch_id}.run*"):
            theirs = json.loads(record.read_text())["sources"]
            if ours and theirs and ours != theirs:
                writer = record.name.split(".run")[-1]
                raise ChangeoverError(
                    f"replay of batch {batch_id} of stage {context.stage} of job {context.job} by run "
                    f"{context.run_id} into {self.path}", f"the sink's log has that batch id from run {writer}, "
                    f"planned from other source offsets ({_shown(theirs)}, not {_shown(ours)}): skipping it "
                    "would lose this run's rows", f"resume the job from its newest savepoint with the sink rewound: "
                    f"`changeover submit CODE --name {context.job} --from-savepoint NAME --rewind-sink`")

    def written_by(self, context: WriteContext) -> bool:
        return any((self.root / BATCHES).glob(f"*.run{context.run_id}"))

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "guarantee": self.guarantee, "path": self.path, "format": self.format,
                "partition_by": list(self.partition_by), "options": dict(self.options)}

    @classmethod
    def from_description(cls, description: dict[str, Any]) -> Files:
        return cls(description["path"], description.get("format", "parquet"),
                   tuple(description.get("partition_by", ())), dict(description.get("options", {})))

    def progress(self, context: WriteContext) -> int | None:
        batches = [b for p in self.log.iterdir() if (b := _log_batch(p.name)) is not None] if self.log.is_dir() else []
        return max(batches) if batches else None

    def snapshot(self, context: WriteContext, batch: int, target: Path) -> None:
        """Copy the log entries up to `batch`: exactly the log Spark had when it committed that batch."""
        target.mkdir(parents=True, exist_ok=True)
        for file in self.log.iterdir() if self.log.is_dir() else []:
            number = _log_batch(file.name)
            if number is not None and number <= batch:
                shutil.copy2(file, target / file.name)

    def rewind(self, context: WriteContext, batch: int | None, saved: Path | None) -> str:
        if saved is None and batch is not None:
            raise ChangeoverError(f"rewind of the file sink at {self.path}", "the savepoint holds no copy of its log",
                                  "resume from a savepoint taken with this version of Changeover")
        keep = log_entries(saved) if saved is not None else set()
        doomed = sorted(log_entries(self.log) - keep)
        for data_file in doomed:
            Path(data_file).unlink(missing_ok=True)
        shutil.rmtree(self.log, ignore_errors=True)
        if saved is not None:
            shutil.copytree(saved, self.log)
        for record in (self.root / BATCHES).glob("*.run*"):
            number = record.name.split(".")[0]
            if number.isdigit() and (batch is None or int(number) > batch):
                record.unlink()
        return f"deleted {len(doomed)} data file(s) written after batch {batch}; log trimmed to batch {batch}"

    def shadow(self, batch: Any, scratch: Path) -> None:
        writer = batch.write.format(self.format).options(**self.options).mode("overwrite")
        (writer.partitionBy(*self.partition_by) if self.partition_by else writer).save(str(scratch))

    def redirected(self, suffix: str) -> Files:
        return replace(self, path=f"{self.path.rstrip('/')}__{suffix}")


def _or_before(batch: int | None) -> int:
    return -1 if batch is None else batch


def _source_offsets(context: WriteContext, batch_id: int) -> list[object]:
    """The batch's source offsets in its stage's checkpoint; empty when unknown."""
    return checkpoints.source_offsets(Path(context.checkpoint), batch_id) if context.checkpoint else []


def _shown(offsets: list[object]) -> str:
    return "; ".join(o if isinstance(o, str) else json.dumps(o, separators=(",", ":")) for o in offsets)


def _add_to_log(spark: Any, log: Path, batch_id: int, placed: list[Path]) -> None:
    """Spark's own `FileStreamSinkLog` adds the entry (and compacts every tenth), so Spark's reader reads it as it
    reads what Spark's file sink writes."""
    jvm = spark._jvm
    sinks = jvm.org.apache.spark.sql.execution.streaming.sinks
    statuses = spark.sparkContext._gateway.new_array(sinks.SinkFileStatus, len(placed))
    for index, path in enumerate(placed):
        st = path.stat()
        statuses[index] = sinks.SinkFileStatus(path.as_uri(), st.st_size, False, int(st.st_mtime * 1000), 1,
                                               32 * 1024 * 1024, "add")
    sink_log = sinks.FileStreamSinkLog(1, spark._jsparkSession, str(log), jvm.scala.Option.apply(None))
    if not sink_log.add(batch_id, statuses):
        raise ChangeoverError(f"log entry of batch {batch_id} in {log}", "another writer added it first, inside "
                              "the fence", "nothing to do: the batch is written; report this as a bug")
