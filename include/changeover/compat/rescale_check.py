"""Whether each stage of a savepoint can move to another number of state partitions, read from its files.

Spark's offline repartition works only on the RocksDB store and only from the versions the version table marks;
both are known before anything stops. What else Spark refuses (an operator it cannot repartition) shows in the
dry run, which repartitions a scratch copy before it replays a batch (`changeover.compat.dry_run`).
"""

from __future__ import annotations

from pathlib import Path

from changeover.compat import version_table
from changeover.compat.checker import Report
from changeover.compat.rules import Verdict
from changeover.errors import ChangeoverError
from changeover.runtime import checkpoints, state_partitions


def check_count(count: int) -> None:
    if count < 1:
        raise ChangeoverError(f"state partitions {count}", "a stateful stage needs at least one partition",
                              "pass a positive number, or leave it out to keep each stage's count")


def add_findings(report: Report, savepoint: Path, stages: list[str], version: str, count: int) -> list[str]:
    """One finding per stateful stage (and one for a version that cannot repartition). Returns the stages whose
    state moves to `count` partitions."""
    check_count(count)
    measured = version_table.repartition_of(version)
    if measured is None or measured["outcome"] != "ok":
        why = "not measured" if measured is None else f"{measured['outcome']}: {measured['reason']}"
        report.add("CO-SCALE-02", "(every stage)", f"Spark {version}: {why}")
    moving = []
    for stage in stages:
        folder = savepoint / "stages" / stage
        before = state_partitions.partitions(folder)
        if before is None or not state_partitions.has_state(folder):
            continue  # no state: the new count applies to nothing here
        store = state_partitions.provider(folder)
        if store != state_partitions.ROCKSDB:
            report.add("CO-SCALE-01", stage, f"its offset log pins {str(store).rsplit('.', 1)[-1]}, with {before} "
                                             f"partitions")
        elif before == count:
            report.add("CO-SCALE-04", stage, f"it has {count} partitions already: kept as it is")
        else:
            report.add("CO-SCALE-04", stage, f"{before} -> {count} partitions, on a copy laid out for the new run")
            moving.append(stage)
    return moving


def require(job: str, savepoint: str, path: Path, version: str, count: int) -> list[str]:
    """Refuse, before anything is laid out or launched, a resume whose state cannot move to `count` partitions.
    Returns the stages that will be repartitioned."""
    report = Report(job, savepoint)
    moving = add_findings(report, path, checkpoints.stage_names(path / "stages"), version, count)
    refused = [finding for finding in report.findings if finding.verdict > Verdict.COMPATIBLE_WITH_WARNING]
    if refused:
        raise ChangeoverError(f"resume of job {job} from savepoint {savepoint} with {count} state partitions",
                              "; ".join(finding.line() for finding in refused),
                              "resume without a new partition count (the savepoint is as it was), or as each "
                              "finding's fix says")
    return moving
