"""How fresh a job's output stayed through a move: for every input file read around it, the time from the file's
arrival to the commit of the batch that read it.

A file source logs each file it lists with its modification time (`sources/<i>/<n>` in the stage's checkpoint, one
JSON line a file), and a batch's commit file is written once its sink has its output: the gap between the two is
how long that input took to reach the sink, whatever the job computes. Around a move the largest gap is the
downtime as a reader of the output feels it: the files that arrived while the old run parked and the new one took
over waited longest. Stages without a file source have nothing to measure (None).
"""

from __future__ import annotations

import contextlib
import json
import statistics
from collections.abc import Callable
from pathlib import Path

from changeover.runtime import checkpoints

AROUND = 3  # the new run's first batches, from the cut-over's on
USUAL_OF = 10  # the old run's last batches, for the gap it usually had
USUAL_AT_LEAST = 3  # batches with file input among them, for a figure


def arrivals(stage: Path, batch: int) -> list[float] | None:
    """The modification times (POSIX seconds) of the files batch `batch` of a stage read from its file sources;
    None when the checkpoint no longer says which (Spark purged the batch's offsets, or the one before)."""
    offsets = stage / "offsets"
    if not (offsets / str(batch)).exists() or (batch > 0 and not (offsets / str(batch - 1)).exists()):
        return None
    ends, starts = checkpoints.source_log_ends(stage, batch), checkpoints.source_log_ends(stage, batch - 1)
    found: list[float] = []
    for source, end in ends.items():
        for entry in range(starts.get(source, -1) + 1, end + 1):
            found += _logged_files(stage / "sources" / source, entry)
    return found


def _logged_files(log: Path, entry: int) -> list[float]:
    """A compacted entry (every tenth) holds the whole log so far, and once Spark has deleted a plain entry only a
    later compaction holds it: only lines of this entry's own batch count."""
    for name in (str(entry), f"{entry}.compact", None):
        if name is None:  # listed only when the entry's own file is gone
            later = [n for p in log.glob("*.compact") if (n := int(p.name.split(".")[0])) > entry]
            if not later:
                return []
            name = f"{min(later)}.compact"
        with contextlib.suppress(FileNotFoundError):
            logged = [json.loads(line) for line in (log / name).read_text().splitlines()[1:] if line.startswith("{")]
            return [file["timestamp"] / 1000 for file in logged if file.get("batchId") == entry]
    return []


def _committed_at(stage: Path, batch: int) -> float | None:
    try:
        return (stage / "commits" / str(batch)).stat().st_mtime
    except FileNotFoundError:
        return None


def _gaps(stage: Path, batch: int) -> list[float] | None:
    """The arrival-to-commit gap of each file batch `batch` of a stage read; None when it has not committed or the
    checkpoint no longer says which files it read."""
    committed = _committed_at(stage, batch)
    read = arrivals(stage, batch) if committed is not None else None
    return None if committed is None or read is None else [committed - arrived for arrived in read]


def largest_gap(before: Path, after: Path, around: int = AROUND) -> float | None:
    """The largest arrival-to-commit gap of the files read by the first `around` batches of the run that took a stage
    over (`after`) from the run that gave it up (checkpoint `before`): every file that arrived after the old run
    planned its last batch is among them, those that waited out the cut-over first. The old run's own batches are
    not the move's: they carry whatever happened to the job before it (an executor lost in an earlier drain, say).
    None without file input."""
    last = checkpoints.last_commit(before)
    if last is None:
        return None
    gaps: list[float] = []
    for batch in range(last + 1, last + around + 1):
        found = _gaps(after, batch)
        if found is None and batch == last + 1:
            return None  # the cut-over's own batch is what the figure is about: without it, no figure
        gaps += found or []
    return max(gaps, default=None)


def usual_gap(before: Path, since: float, batches: int = USUAL_OF) -> float | None:
    """The baseline a move's gap compares with: the median, over the old run's last `batches` batches of its own, of
    each batch's largest gap. Its own: committed since `since` (its first commit as the job's run; the batches before
    are a restored savepoint's or a follower's replays), less the first AROUND, which carry the move that brought the
    job to it. A median, so that one stall of the job before the move does not make a slow cut-over look usual. None
    without file input, or with fewer than USUAL_AT_LEAST such batches to go by."""
    own: list[int] = []  # newest first; past `batches + AROUND` of them the first AROUND are not among the last
    batch = checkpoints.last_commit(before)
    while len(own) < batches + AROUND and batch is not None and batch >= 0 \
            and (committed := _committed_at(before, batch)) is not None and committed >= since:
        own.append(batch)
        batch -= 1
    largest = [max(found) for batch in own[:-AROUND][:batches] if (found := _gaps(before, batch))]
    return statistics.median(largest) if len(largest) >= USUAL_AT_LEAST else None


def of_move(before_root: str | None, after_root: str | None) -> float | None:
    """The largest gap over a job's stages, for a move from one run's checkpoint root to another's."""
    return _over_stages(before_root, after_root, largest_gap)


def usual_before_move(before_root: str | None, after_root: str | None, since: float | None) -> float | None:
    """The old run's usual gap (`usual_gap`, its batches committed since `since`) before a move, its slowest stage's
    among those the new run has."""
    if since is None:
        return None
    return _over_stages(before_root, after_root, lambda before, _after: usual_gap(before, since))


def _over_stages(before_root: str | None, after_root: str | None,
                 measure: Callable[[Path, Path], float | None]) -> float | None:
    """The largest of `measure(old stage checkpoint, new stage checkpoint)` over the new run's stages."""
    if not before_root or not after_root:
        return None
    found = [gap for stage in checkpoints.stage_names(Path(after_root))
             if (gap := measure(Path(before_root) / stage, Path(after_root) / stage)) is not None]
    return max(found) if found else None
