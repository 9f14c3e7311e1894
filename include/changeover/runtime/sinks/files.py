"""Spark's own file sink (parquet, json, csv) and its `_spark_metadata` log.

The log makes the sink exactly-once: a batch id already in it is skipped. That is also its trap: restored to
an older savepoint, the query replays batches the log has, and Spark skips them silently. So a savepoint keeps
the log as of its batch, and a rewind deletes the data files that later entries added and puts that log back.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import unquote, urlparse

from changeover.errors import ChangeoverError
from changeover.runtime.sinks.base import Sink, WriteContext

FORMATS = ("parquet", "json", "csv", "orc", "text")
LOG = "_spark_metadata"


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
    fenced: ClassVar[bool] = False
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
    def log(self) -> Path:
        return Path(urlparse(self.path).path if self.path.startswith("file:") else self.path) / LOG

    def attach(self, frame: Any, context: WriteContext) -> Any:
        writer = frame.writeStream.format(self.format).option("path", self.path).options(**self.options)
        return writer.partitionBy(*self.partition_by) if self.partition_by else writer

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
        return f"deleted {len(doomed)} data file(s) written after batch {batch}; log trimmed to batch {batch}"

    def redirected(self, suffix: str) -> Files:
        return replace(self, path=f"{self.path.rstrip('/')}__{suffix}")
