"""Which Spark version can resume a savepoint written by which: a version table, measured rather than assumed.

`python -m changeover.compat.version_table` writes a stateful checkpoint (an aggregation, a windowed
aggregation and a deduplication) with each installed runtime, resumes a copy of it with each runtime on
more input, and records whether the resumed run was exact, wrong, or refused. The result is kept in
version_table.json; the checker reads it and docs/compatibility.md shows it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from changeover.cluster.runtimes import SUPPORTED_VERSIONS, find_runtime, installed_versions, java_home
from changeover.compat import version_probe
from changeover.errors import ChangeoverError
from changeover.settings import Settings

TABLE = Path(__file__).with_name("version_table.json")
PROBE = Path(version_probe.__file__)


def _probe(settings: Settings, version: str, action: str, folder: Path, checkpoint: Path
           ) -> subprocess.CompletedProcess[str]:
    runtime = find_runtime(settings.runtimes_dir, version)
    env = {**os.environ, **runtime.java_env(java_home()), "SPARK_LOCAL_IP": "127.0.0.1",
           "PYSPARK_PYTHON": str(runtime.python)}
    env.pop("PYTHONPATH", None)
    return subprocess.run([str(runtime.python), str(PROBE), action, str(folder), str(checkpoint)], env=env,
                          capture_output=True, text=True, timeout=600)


def _error(stderr: str) -> str:
    """The first line of Spark's error: its error class, or the assertion it failed."""
    for line in stderr.splitlines():
        for mark in ("[STATE_", "[STREAMING_", "[INCOMPATIBLE", "AssertionError", "Exception:"):
            if mark in line:
                return line[line.index(mark):][:200]
    lines = [line for line in stderr.splitlines() if line.strip()]
    return lines[-1][:200] if lines else "no output"


def measure_cell(settings: Settings, created: Path, resumed_with: str, scratch: Path) -> dict[str, Any]:
    """Resume a copy of the checkpoint written into `created`; the input folder is put back to part 0 only."""
    folder = scratch / "input"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(created / "input", folder)
    checkpoint = scratch / f"{created.name}-resumed-with-{resumed_with}"
    shutil.copytree(created / "checkpoint", checkpoint)
    result = _probe(settings, resumed_with, "resume", folder, checkpoint)
    found = [line for line in result.stdout.splitlines() if line.startswith(version_probe.MARKER)]
    if result.returncode != 0 or not found:
        return {"outcome": "refused", "reason": _error(result.stderr)}
    report = json.loads(found[-1].removeprefix(version_probe.MARKER))
    if report["exact"]:
        return {"outcome": "ok", "reason": "resumed exact"}
    return {"outcome": "wrong results", "reason": f"got {report['got']}, expected {report['expected']}"}


def measure_repartition(settings: Settings, version: str, scratch: Path) -> dict[str, Any]:
    """Whether `version` repartitions a RocksDB checkpoint it wrote (2 -> 3 partitions) and resumes it exact."""
    folder, created = scratch / "input", scratch / f"rocksdb-{version}"
    shutil.rmtree(folder, ignore_errors=True)
    result = _probe(settings, version, "create-rocksdb", folder, created)
    if result.returncode != 0:
        return {"version": version, "outcome": "refused", "reason": _error(result.stderr)}
    result = _probe(settings, version, "rescale", folder, created)
    found = [line for line in result.stdout.splitlines() if line.startswith(version_probe.MARKER)]
    if result.returncode != 0 or not found:
        return {"version": version, "outcome": "refused", "reason": _error(result.stderr)}
    report = json.loads(found[-1].removeprefix(version_probe.MARKER))
    return {"version": version, "outcome": "ok" if report["exact"] else "wrong results",
            "reason": f"{version_probe.RESCALED_TO - 1} -> {version_probe.RESCALED_TO} partitions, resumed "
                      + ("exact" if report["exact"] else f"with {report['got']}, expected {report['expected']}")}


def measure(settings: Settings, versions: list[str]) -> dict[str, Any]:
    cells = []
    with tempfile.TemporaryDirectory(prefix="version-table-") as scratch:
        for created_with in versions:
            # One input path for the whole run: the checkpoint's source log names it absolutely.
            folder, created = Path(scratch) / "input", Path(scratch) / f"created-{created_with}"
            shutil.rmtree(folder, ignore_errors=True)
            result = _probe(settings, created_with, "create", folder, created / "checkpoint")
            if result.returncode != 0:
                raise RuntimeError(f"Spark {created_with} could not write the checkpoint: {_error(result.stderr)}")
            shutil.copytree(folder, created / "input")
            for resumed_with in versions:
                cells.append({"created_with": created_with, "resumed_with": resumed_with,
                              **measure_cell(settings, created, resumed_with, Path(scratch))})
        repartition = [measure_repartition(settings, version, Path(scratch)) for version in versions]
    return {"measured_at": datetime.now(UTC).isoformat(timespec="seconds"), "python": sys.version.split()[0],
            "cells": cells, "repartition": repartition}


def load() -> dict[str, Any]:
    return json.loads(TABLE.read_text())


def cell(created_with: str, resumed_with: str, table: dict[str, Any] | None = None) -> dict[str, Any] | None:
    for entry in (table or load())["cells"]:
        if (entry["created_with"], entry["resumed_with"]) == (created_with, resumed_with):
            return entry
    return None


def require_resumable(created_with: str, resumed_with: str, what: str) -> None:
    """Refuse up front what the measured table says Spark cannot resume exactly (e.g. a downgrade)."""
    if created_with == resumed_with or not TABLE.exists():
        return
    found = cell(created_with, resumed_with)
    if found is not None and found["outcome"] != "ok":
        raise ChangeoverError(what, f"state written by Spark {created_with} was {found['outcome']} when Spark "
                                    f"{resumed_with} resumed it in Changeover's measurements ({found['reason']})",
                              f"resume it on Spark {created_with}, or on a version the table in docs/compatibility.md "
                              "marks yes")


def repartition_of(version: str, table: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The measured offline repartition of state on `version`, or None if it was not measured."""
    return next((entry for entry in (table or load()).get("repartition", []) if entry["version"] == version), None)


def render(table: dict[str, Any]) -> str:
    """The docs' table: rows are the version that wrote the savepoint, columns the one resuming it."""
    versions = [v for v in SUPPORTED_VERSIONS if any(c["created_with"] == v for c in table["cells"])]
    marks = {"ok": "yes", "wrong results": "WRONG RESULTS", "refused": "refused"}
    lines = ["| created with \\ resumed with | " + " | ".join(versions) + " |",
             "|---|" + "---|" * len(versions)]
    for created in versions:
        row = [marks[c["outcome"]] if (c := cell(created, resumed, table)) else "not measured" for resumed in versions]
        lines.append(f"| {created} | " + " | ".join(row) + " |")
    if table.get("repartition"):
        lines += ["", "| Spark version | " + " | ".join(versions) + " |", "|---|" + "---|" * len(versions),
                  "| repartitions state offline (`--state-partitions`) | "
                  + " | ".join(marks[e["outcome"]] if (e := repartition_of(v, table)) else "not measured"
                               for v in versions) + " |"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """All cells; with --repartition, only the repartition row (the resume cells kept as measured)."""
    settings = Settings.from_env()
    versions = installed_versions(settings.runtimes_dir)
    if "--repartition" in (sys.argv[1:] if argv is None else argv):
        table = load()
        with tempfile.TemporaryDirectory(prefix="version-table-") as scratch:
            table["repartition"] = [measure_repartition(settings, v, Path(scratch)) for v in versions]
        table["repartition_measured_at"] = datetime.now(UTC).isoformat(timespec="seconds")
    else:
        table = measure(settings, versions)
    TABLE.write_text(json.dumps(table, indent=1) + "\n")
    print(render(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
