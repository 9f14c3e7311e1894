"""Savepoint cost against `cp -r` of the same checkpoint, timed side by side in one run.

The checkpoint is laid out as Spark writes it (offsets, commits, sources, and state delta and
snapshot files per operator, partition and version) with files of random bytes, so that the cost
is the filesystem's, as it is for a real job. Each figure is the median of --repeat runs.

    .venv/bin/python bench/savepoint_cost.py [--sizes-mb 10 100 1024] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from changeover import savepoints
from changeover.registry.db import session_scope
from changeover.registry.models import Job, JobRun
from changeover.registry.schema import migrate
from changeover.registry.states import RunState
from changeover.settings import Settings

PARTITIONS = 4
FILE_MB = 2


def build_checkpoint(root: Path, size_mb: int) -> int:
    """A stage checkpoint of about size_mb of state; returns its last committed batch."""
    files = max(1, size_mb // FILE_MB)
    batches = max(2, files // PARTITIONS)
    stage = root / "totals"
    for directory in ("offsets", "commits", "sources/0"):
        (stage / directory).mkdir(parents=True, exist_ok=True)
    (stage / "metadata").write_text('{"id":"bench"}')
    for batch in range(batches):
        (stage / "offsets" / str(batch)).write_text(f'v1\n{{"batchWatermarkMs":0}}\n{{"logOffset":{batch}}}\n')
        (stage / "commits" / str(batch)).write_text('v1\n{"nextBatchWatermarkMs":0}\n')
        (stage / "sources" / "0" / str(batch)).write_text(f'v1\n{{"path":"file:///x","batchId":{batch}}}\n')
    for index in range(files):
        partition, version = index % PARTITIONS, index // PARTITIONS + 1
        folder = stage / "state" / "0" / str(partition)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{version}.delta").write_bytes(os.urandom(FILE_MB << 20))
    return batches - 1


def timed(action: Callable[..., object], *args: object, **kwargs: object) -> float:
    started = time.perf_counter()
    action(*args, **kwargs)
    return time.perf_counter() - started


def measure(settings: Settings, root: Path, work: Path, run_id: int, repeat: int) -> dict[str, float]:
    cp, first, nxt, stop = [], [], [], []
    for i in range(repeat):
        target = work / f"cp-{i}"
        cp.append(timed(subprocess.run, ["cp", "-r", str(root), str(target)], check=True))
        shutil.rmtree(target)
        first.append(timed(savepoints.take, settings, "bench", f"first-{i}", mode="continue"))
        (settings.savepoint_dir / "bench" / ".digests.json").unlink()  # the next 'first' is cold again
    savepoints.take(settings, "bench", "warm", mode="continue")
    for i in range(repeat):
        nxt.append(timed(savepoints.take, settings, "bench", f"next-{i}", mode="continue"))
    with session_scope(settings.database_url) as s:
        s.get(JobRun, run_id).state = RunState.PARKED
    for i in range(repeat):
        stop.append(timed(savepoints.take, settings, "bench", f"stop-{i}", mode="stop"))
    return {k: statistics.median(v) for k, v in {"cp": cp, "first": first, "next": nxt, "stop": stop}.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[10, 100, 1024])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="Where to build (default: a temp dir in .changeover)")
    args = parser.parse_args()
    base = args.dir or Path(__file__).resolve().parents[1] / ".changeover" / "bench"
    base.mkdir(parents=True, exist_ok=True)
    print(f"{'state':>8} {'cp -r':>8} {'continue (first)':>17} {'continue (next)':>16} {'stop':>8} "
          f"{'first/cp':>9} {'next/cp':>8} {'stop/cp':>8}")
    for size in args.sizes_mb:
        work = Path(tempfile.mkdtemp(prefix=f"sp-{size}mb-", dir=base))
        try:
            settings = Settings.from_env(home=work / "home", database_url=f"sqlite:///{work / 'registry.db'}")
            migrate(settings.database_url)
            root = work / "checkpoint"
            build_checkpoint(root, size)
            with session_scope(settings.database_url) as s:
                s.add(Job(name="bench", module="jobs.clicks", fault_tolerant=True, block_shutdown=False, options={}))
                s.flush()
                run = JobRun(job="bench", spark_version="4.2.0", master_url="-", state="RUNNING",
                             checkpoint_root=str(root), progress={})
                s.add(run)
                s.flush()
                s.get(Job, "bench").current_run_id = run_id = run.id
            m = measure(settings, root, work, run_id, args.repeat)
            print(f"{size:>6}MB {m['cp']:>7.2f}s {m['first']:>16.2f}s {m['next']:>15.2f}s {m['stop']:>7.2f}s "
                  f"{m['first'] / m['cp']:>8.1%} {m['next'] / m['cp']:>7.1%} {m['stop'] / m['cp']:>7.1%}")
        finally:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
