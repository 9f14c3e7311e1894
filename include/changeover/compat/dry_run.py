"""The dry run: the new code restored from scratch copies of a savepoint, on the target runtime, one batch each.

Each stateful stage's checkpoint is copied (never linked) as of the batch before the savepoint's last one,
with that last batch's offsets kept, so Spark replays it from the saved state with the same input. Its rows
go to Spark's `noop` sink. The running job, its savepoints and its sinks are never touched. Spark's errors
come back in the rule catalogue's language.
"""

from __future__ import annotations

import json
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from changeover.cluster.shipping import JobCode
from changeover.compat.checker import Report
from changeover.compat.dry_run_job import MARKER
from changeover.compat.extract import in_runtime
from changeover.errors import ChangeoverError
from changeover.runtime import checkpoints
from changeover.settings import Settings

# Spark's error classes (and one message of the offset log's), and the rule each one breaks.
SPARK_ERRORS = (
    ("STATE_STORE_VALUE_SCHEMA_NOT_COMPATIBLE", "CO-VAL-01"),
    ("STATE_STORE_KEY_SCHEMA_NOT_COMPATIBLE", "CO-KEY-02"),
    ("STREAMING_STATEFUL_OPERATOR_NOT_MATCH_IN_STATE_METADATA", "CO-OPS-02"),
    ("STATEFUL_OPERATOR_NOT_MATCH", "CO-OPS-02"),
    ("sources in the checkpoint offsets", "CO-SRC-01"),
    ("STATE_REPARTITION", "CO-SCALE-03"),
)


@dataclass(frozen=True)
class Replay:
    stage: str  # the stage's name in the new code
    saved_as: str  # its name in the savepoint
    batch: int


def rule_of(error: str) -> str:
    return next((rule for mark, rule in SPARK_ERRORS if mark in error), "CO-DRY-01")


def first_line(error: str) -> str:
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    return (lines[0] if lines else "no message")[:400]


def lay_out(savepoint: Path, stages: list[str], renames: dict[str, str], scratch: Path) -> list[Replay]:
    """Copy each saved stage that committed a batch into scratch/<new name>, set back to replay that batch."""
    replays = []
    for saved_as in stages:
        source = savepoint / "stages" / saved_as
        last = checkpoints.last_commit(source)
        if last is None:
            continue  # no batch to replay: the stage never committed one
        stage = renames.get(saved_as, saved_as)
        checkpoints.snapshot_stage(source, scratch / stage, last - 1, link=False)
        checkpoints.snapshot_pending(source, scratch / stage, last - 1, link=False)
        replays.append(Replay(stage, saved_as, last))
    return replays


def dry_run(settings: Settings, report: Report, shipped: JobCode, savepoint: Path, stages: list[str],
            version: str, options: dict[str, Any], renames: dict[str, str] | None = None,
            timeout: float = 180, rescaled: dict[str, int] | None = None) -> dict[str, Any]:
    """Replay each of `stages` (saved stages the new code keeps) once on `version`; add what Spark refused to
    `report`. Returns per stage the batch replayed and its input rows, or the error. `rescaled`: stages (by their
    new names) whose copy is repartitioned to that many state partitions first; their batch is replayed after the
    repartition's own, as the resumed run would."""
    renames = dict(renames or {})
    scratch = settings.home / "scratch" / f"dry-run-{report.job}-{secrets.token_hex(4)}"
    try:
        replays = lay_out(savepoint, stages, renames, scratch)
        if not replays:
            return {}
        try:
            results = in_runtime(
                settings, version, shipped, "changeover.compat.dry_run_job",
                ["--job", report.job, "--checkpoints", str(scratch), "--timeout", str(timeout),
                 "--replay", json.dumps({r.stage: r.batch for r in replays}),
                 "--rescale", json.dumps(rescaled or {})],
                options, MARKER, f"the dry run of job {report.job}", timeout=timeout + 240)
        except ChangeoverError as exc:  # the code did not build or run at all (a timeout or a missing runtime
            # is not the code's fault: it propagates, and the task is retried)
            report.add("CO-DRY-01", "(every stage)", f"Spark {version}: {first_line(str(exc))}")
            return {"error": str(exc)}
        for replay in replays:
            result = results.get(replay.stage) or {"timeout": timeout}
            if "error" in result:
                report.add(rule_of(result["error"]), replay.stage,
                           f"Spark {version} refused batch {replay.batch} replayed from the savepoint"
                           + (f" after repartitioning its state to {rescaled[replay.stage]}" if replay.stage in
                              (rescaled or {}) else "") + f": {first_line(result['error'])}")
            elif "timeout" in result:
                report.add("CO-DRY-02", replay.stage, f"batch {replay.batch} not done in {timeout:.0f} s")
        return results
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
