"""A consistent copy of one stage's Structured Streaming checkpoint as of a committed batch.

Files of committed batches never change, so the copy hard-links them where the store is on the
same filesystem and copies bytes only across filesystems. The source may be a running query: files
that vanish mid-walk are tolerated, and everything newer than batch N is pruned (offsets, commits
and source logs > N, state versions > N + 1, later metadata and schema files, temporary files).

State store layouts (Spark 4.x), under state/<operator>/<partition>/:
  <version>.delta|.snapshot                       HDFS-backed provider (default store)
  <store>/<version>.delta|.snapshot               stream-stream join (join state format 1 and 2): four named
                                                  stores, left|right-keyToNumValues|keyWithIndexToValue
  <version>[_<uuid>].zip|.changelog               RocksDB provider; _<uuid> with checkpointFormatVersion 2
  SSTs/<rocksdb file no>-<uuid>.sst, logs/...     RocksDB files shared by versions: the number is not a version
  _metadata/schema                                key and value schemas (also under a named store)
and under state/<operator>/: _metadata/metadata, _metadata/v2/<batch> and _stateSchema/<store>/<batch>_<uuid>.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import secrets
import shutil
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from changeover.errors import ChangeoverError
from changeover.registry.models import utcnow
from changeover.settings import Settings

log = logging.getLogger(__name__)

_LEADING_NUMBER = re.compile(r"^\.?(\d+)")
_CROSS_DEVICE = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP}
# Folders of a RocksDB store whose files are shared between versions, named <RocksDB file number>-<uuid>.
_ROCKSDB_SHARED = {"SSTs", "logs"}
# In a stage folder during a rescale (`state_partitions`): the planned batch's offsets, out of the log while Spark
# repartitions; copied with the batch it was planned after (`snapshot_pending`), never as a file of the state.
SET_ASIDE = ".rescale-pending"


@dataclass
class CopyStats:
    files: dict[str, os.stat_result] = field(default_factory=dict)  # relative path -> stat of the copy
    linked: int = 0
    copied_bytes: int = 0


def _batch_of(name: str) -> int | None:
    match = _LEADING_NUMBER.match(name)
    return int(match.group(1)) if match else None


def _checksummed(name: str) -> str | None:
    """The file a Hadoop checksum `.<file>.crc` is of; None for any other name."""
    return name[1:-4] if name.startswith(".") and name.endswith(".crc") else None


def keep(relative: str, batch: int, log_ends: dict[str, int] | None = None) -> bool:
    """Whether a checkpoint file (path relative to the stage folder) belongs to the state as of `batch`.

    log_ends: for each file source (by its folder under sources/), the last entry of its own log that batch's
    offsets point at (`source_log_ends`). A file source numbers its log apart from the batch ids: a run stopped
    while planning leaves an entry without offsets, and the next run's first batch takes that entry and a new one,
    so from then on the source's entry of batch N is N + 1 or more."""
    parts = relative.split(os.sep)
    name = parts[-1]
    if name.endswith(".tmp") or ".tmp." in name or relative == SET_ASIDE:
        return False
    if (checked := _checksummed(name)) is not None:
        # Hadoop's local filesystem writes .<file>.crc beside every file it writes, and verifies it on read. It
        # goes with its file: a kept file keeps its checksum, a pruned one's must not outlive it. (Spark's own
        # <file>.crc, state files of checkpoint format 2, starts with its file's name and follows the same rules.)
        return keep(os.sep.join([*parts[:-1], checked]), batch, log_ends)
    number = _batch_of(name)
    if parts[0] == "sources" and len(parts) == 3:
        return number is None or number <= (log_ends or {}).get(parts[1], batch)
    if parts[0] in ("offsets", "commits"):
        return number is None or number <= batch
    if parts[0] == "state":
        if "_metadata" in parts or "_stateSchema" in parts:  # named by the batch that wrote them, if at all
            return number is None or number <= batch
        if len(parts) in (5, 6) and parts[-2] in _ROCKSDB_SHARED:
            return True  # a kept version's .zip may list any of them: `snapshot_stage` takes only those listed
        if len(parts) in (4, 5):  # state/<op>/<partition>[/<store>]/<version>[_<uuid>].<kind>[.crc]
            return number is None or number <= batch + 1
    return True


def source_log_ends(stage: Path, batch: int) -> dict[str, int]:
    """Each file source's `logOffset` in the offsets of `batch` (sources/<i> by i). Sources of other kinds, and
    sources with no offset yet ("-"), are left out."""
    return _log_ends(stage, batch, offset_entry(stage, batch))


def _log_ends(stage: Path, batch: int, lines: list[str]) -> dict[str, int]:
    if lines and lines[0] != "v1":
        raise ChangeoverError(f"checkpoint {stage}", f"its offset log entry {stage / 'offsets' / str(batch)} is in "
                              f"format {lines[0]}, and Changeover reads only format v1 (Spark's default) to tell which "
                              "source log entries a batch holds",
                              "run the job with spark.sql.streaming.offsetLog.formatVersion=1")
    return {str(index): offset["logOffset"] for index, offset in enumerate(_parsed(lines[2:]))
            if isinstance(offset, dict) and isinstance(offset.get("logOffset"), int)}


def materialise(source: str | Path, target: str | Path, *, link: bool = True) -> str | None:
    """Hard-link source to target, or copy it. Returns "linked", "copied", or None if the source vanished."""
    try:
        if link:
            try:
                os.link(source, target)
                return "linked"
            except FileNotFoundError:
                raise
            except OSError as exc:
                if exc.errno not in _CROSS_DEVICE:
                    raise
        shutil.copy2(source, target)
        return "copied"
    except FileNotFoundError:  # the source vanished, or the target's folder is not there yet
        if not os.path.exists(source):
            return None
        parent = os.path.dirname(target)
        if os.path.isdir(parent):
            raise
        os.makedirs(parent, exist_ok=True)
        return materialise(source, target, link=link)


def referenced_shared_files(store: str, names: list[str], relative_dir: str, batch: int,
                            log_ends: dict[str, int]) -> set[str] | None:
    """The shared files (SSTs/<name>, logs/<name>) that the RocksDB versions of a store kept for `batch` list in
    their zips' metadata. A running query uploads the next version's SSTs before its zip, under their final names:
    one not yet listed may still be growing, and is never read by a kept version. None when a kept zip cannot be
    read: every shared file is kept then."""
    referenced: set[str] = set()
    for name in names:
        if not name.endswith(".zip") or not keep(os.path.join(relative_dir, name), batch, log_ends):
            continue
        try:
            with zipfile.ZipFile(os.path.join(store, name)) as archive:
                text = archive.read("metadata").decode()
            metadata = json.loads(next(line for line in text.splitlines() if line.startswith("{")))
        except FileNotFoundError:
            continue  # removed by Spark's maintenance meanwhile: no version of it is kept
        except (OSError, KeyError, StopIteration, ValueError, zipfile.BadZipFile) as exc:
            log.warning("every shared RocksDB file of %s is kept: its version %s could not be read (%s)", store,
                        name, exc)
            return None
        referenced.update(os.path.join("SSTs", f["dfsSstFileName"]) for f in metadata.get("sstFiles") or [])
        referenced.update(os.path.join("logs", f["dfsLogFileName"]) for f in metadata.get("logFiles") or [])
    return referenced


def snapshot_stage(source: Path, target: Path, batch: int, *, link: bool = True, prefix: str = "") -> CopyStats:
    """Materialise the files of `source` kept for `batch` under `target`. Plain os calls: this is the hot
    path of a savepoint, one call per checkpoint file. Of a RocksDB store's shared files, only those its kept
    versions list are taken (`referenced_shared_files`)."""
    stats = CopyStats()
    base = len(str(source)) + 1
    log_ends = source_log_ends(source, batch)
    shared: dict[str, set[str] | None] = {}  # a RocksDB store's folder -> the shared files its kept versions list
    for directory, _dirs, files in os.walk(source):  # top-down: a store's folder before its SSTs/ and logs/
        relative_dir = directory[base:]
        if any(name.endswith(".zip") for name in files):
            shared[directory] = referenced_shared_files(directory, files, relative_dir, batch, log_ends)
        store, kind = os.path.split(directory)
        listed = shared.get(store, set()) if kind in _ROCKSDB_SHARED and relative_dir.startswith("state") else None
        made = False
        for name in files:
            relative = os.path.join(relative_dir, name) if relative_dir else name
            if not keep(relative, batch, log_ends):
                continue
            if listed is not None and os.path.join(kind, _checksummed(name) or name) not in listed:
                continue
            destination = os.path.join(target, relative)
            if not made:
                os.makedirs(os.path.dirname(destination), exist_ok=True)
                made = True
            how = materialise(os.path.join(directory, name), destination, link=link)
            if how is None:
                continue
            st = os.stat(destination)
            stats.files[prefix + relative] = st
            if how == "linked":
                stats.linked += 1
            else:
                stats.copied_bytes += st.st_size
    return stats


def snapshot_pending(source: Path, target: Path, batch: int, prefix: str = "", *, link: bool = True) -> CopyStats:
    """The batch Spark planned after `batch`, if it wrote its offsets: the offset entry and the source log
    entries it points at. Restored, Spark replays that batch with exactly those offsets, so a sink that already has
    it recognises it; without them a new plan would give the same batch id other data. A source log entry that no
    offsets point at (a stop while planning) is left behind: its files are listed again, as new, by the next plan."""
    stats = CopyStats()
    planned = os.path.join("offsets", str(batch + 1))
    if (source / planned).exists():
        relatives, pending = [planned], source_log_ends(source, batch + 1)
    elif (source / SET_ASIDE).exists():  # a rescale cut short: its driver's successor puts it back
        entry = json.loads((source / SET_ASIDE).read_text())["entry"].splitlines()
        relatives, pending = [SET_ASIDE], _log_ends(source, batch + 1, entry)
    else:
        return stats
    done = source_log_ends(source, batch)
    logs = sorted(p.name for p in (source / "sources").iterdir()) if (source / "sources").is_dir() else []
    for log in logs:
        first, last = (done.get(log, batch) + 1, pending[log]) if log in pending else (batch + 1, batch + 1)
        # a file source compacts its log: every 10th entry is <entry>.compact
        relatives += [os.path.join("sources", log, f"{n}{suffix}") for n in range(first, last + 1)
                      for suffix in ("", ".compact")]
    for relative in relatives:
        folder, name = os.path.split(relative)
        for each in (relative, os.path.join(folder, f".{name}.crc")):
            if (target / each).exists():  # a log entry is written once: one there already is this one
                continue
            if (source / each).exists() and materialise(source / each, target / each, link=link) is not None:
                stats.files[prefix + each] = os.stat(target / each)
    return stats


GAVE_UP = ".gave-up"  # why a parked or stood-down driver ended on its own: it could not reach the registry


def write_gave_up(root: Path, reason: str) -> None:
    """Beside the checkpoint, on storage the control plane reads, for the `job.end` it records when the driver's
    master reports it ended. Best effort: the driver is ending anyway."""
    written = root / f"{GAVE_UP}.writing"
    try:
        written.write_text(reason)
        written.replace(root / GAVE_UP)
    except OSError as exc:
        log.warning("could not leave the reason a run gave up beside its checkpoint %s: %s", root, exc)


def read_gave_up(root: str | Path | None) -> str | None:
    if not root:
        return None
    try:
        return (Path(root) / GAVE_UP).read_text().strip() or None
    except OSError:
        return None


def same_filesystem(a: Path, b: Path) -> bool:
    a.mkdir(parents=True, exist_ok=True)
    b.mkdir(parents=True, exist_ok=True)
    return a.stat().st_dev == b.stat().st_dev


def stage_names(root: Path) -> list[str]:
    """The stage checkpoints under a job's checkpoint root; dot-folders are set aside, not stages."""
    return sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) if root.is_dir() else []


def _newest_batch(log: Path) -> int | None:
    batches = [int(p.name) for p in log.glob("[0-9]*") if p.name.isdigit()]
    return max(batches) if batches else None


def last_commit(checkpoint: Path) -> int | None:
    return _newest_batch(checkpoint / "commits")


def stateful_operators(stage_checkpoint: Path) -> list[dict[str, object]]:
    """The stateful operators of a stage, from the files Spark's `state-metadata` reader reads.

    `state/<op>/_metadata/metadata` names the operator and its stores; the key and value schemas,
    with field names, are in `state/<op>/<partition>/_metadata/schema`.
    """
    operators = []
    state = stage_checkpoint / "state"
    for op_dir in sorted(state.iterdir(), key=lambda p: p.name) if state.is_dir() else []:
        if not op_dir.name.isdigit():
            continue
        entry: dict[str, object] = {"operator_id": int(op_dir.name)}
        metadata = op_dir / "_metadata" / "metadata"
        if metadata.exists():
            body = json.loads(metadata.read_text().split("\n", 1)[1])
            entry["operator_name"] = body["operatorInfo"]["operatorName"]
            entry["state_stores"] = [store["storeName"] for store in body["stateStoreInfo"]]
        schema = op_dir / "0" / "_metadata" / "schema"
        if schema.exists():
            structs = _json_structs(schema.read_bytes().decode("latin-1"))
            if len(structs) >= 2:
                entry["key_schema"], entry["value_schema"] = structs[0], structs[1]
        operators.append(entry)
    return operators


def _json_structs(text: str) -> list[dict[str, object]]:
    decoder, found, index = json.JSONDecoder(), [], 0
    while (index := text.find('{"type":"struct"', index)) >= 0:
        value, end = decoder.raw_decode(text, index)
        found.append(value)
        index = end
    return found


def last_offsets(checkpoint: Path) -> int | None:
    return _newest_batch(checkpoint / "offsets")


def source_offsets(stage_checkpoint: Path, batch: int) -> list[object]:
    """The source offsets recorded for a batch: the lines after the header in offsets/<batch>."""
    return _parsed(offset_entry(stage_checkpoint, batch)[2:])


def offset_entry(stage_checkpoint: Path, batch: int) -> list[str]:
    """Spark's offset log entry of a batch, by line: a version line, the batch's metadata, then one line per
    source ("-" for a source with no offset yet). Empty when the batch has none."""
    try:
        return (stage_checkpoint / "offsets" / str(batch)).read_text().splitlines()
    except FileNotFoundError:
        return []


def _parsed(lines: list[str]) -> list[object]:
    return [json.loads(line) if line.startswith(("{", "[")) else line for line in lines]


def new_checkpoint_root(settings: Settings, job: str) -> Path:
    """A folder no other run ever had: time-ordered, with a random part, created here so it cannot be reused."""
    root = settings.checkpoint_dir / job / f"{utcnow():%Y%m%dT%H%M%S%f}-{secrets.token_hex(4)}"
    root.mkdir(parents=True)
    return root
