"""What Changeover's runtime costs a query: the same query, input and trigger, bare and under Changeover.

On a one-member local cluster, in the same run, each form of the windowed count (bench/jobs/) first drains a
backlog of files (throughput at saturation, maxFilesPerTrigger 20), then follows a generator writing one file
every 0.5 s (median commit interval at a 1 s trigger), then is stopped (stop latency: bare `query.stop()`;
Changeover from the stop request to the run recorded STOPPED at a batch boundary). Both are launched the same
way, through the master with the same resources; the bare one is an unchanged script with a `__main__` block.

    .venv/bin/python bench/runtime_overhead.py [--backlog 400] [--seconds 60]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path

from changeover import jobs, savepoints
from changeover.cli.generator import Generator
from changeover.cluster import Membership, membership_for, wait_for
from changeover.cluster.spark_settings import SparkSettings
from changeover.settings import Settings
from scratch import scratch_settings

JOBS = Path(__file__).resolve().parent / "jobs"


def commits(checkpoint: Path) -> list[tuple[int, float]]:
    """Each commit file's batch and time; one Spark purges (minBatchesToRetain) while this reads is left out."""
    folder = checkpoint / "commits"
    found = []
    for path in folder.iterdir() if folder.is_dir() else []:
        if path.name.isdigit():
            with contextlib.suppress(FileNotFoundError):
                found.append((int(path.name), path.stat().st_mtime))
    return sorted(found)


def measure(settings: Settings, cluster: Membership, form: str, backlog: int, seconds: float) -> dict[str, float]:
    work = settings.home / form
    generator = Generator(work / "landing", seed=11)
    for _ in range(backlog):
        generator.write_file()
    output = work / "output"
    spark = asdict(SparkSettings(py_files=(str(JOBS / "window_query.py"),)))
    started = time.time()
    if form == "bare":
        checkpoint = work / "checkpoint"
        config = {"landing": str(generator.landing), "output": str(output), "checkpoint": str(checkpoint),
                  "stop_file": str(work / "stop"), "stopped_file": str(work / "stopped")}
        (settings.home / "bench-bare.json").write_text(json.dumps(config))
        jobs.submit(settings, cluster, str(JOBS / "window_counts_bare.py"), form, fault_tolerant=False,
                    options={"spark": spark})
    else:
        run = jobs.submit(settings, cluster, str(JOBS / "window_counts.py"), form,
                          options={"landing": str(generator.landing), "output": str(output), "spark": spark})
        checkpoint = Path(run.checkpoint_root or "") / "counts"
    last_backlog_batch = (backlog + 19) // 20 - 1
    wait_for(lambda: any(b >= last_backlog_batch for b, _ in commits(checkpoint)), 900, f"{form} draining the backlog")
    drained = commits(checkpoint)
    first, last = drained[0][1], drained[-1][1]
    throughput = (backlog - 20) * generator.events_per_file / (last - first)  # batch 0 pays the cold start
    generator.start(interval=0.5)
    steady_from = time.time()
    time.sleep(seconds)  # a measurement window, not a synchronisation
    steady = [t for _b, t in commits(checkpoint) if t >= steady_from]
    interval = statistics.median(b - a for a, b in zip(steady, steady[1:], strict=False))
    if form == "bare":  # stopped while the input still flows, as a drain finds a job
        (work / "stop").touch()
        wait_for(lambda: (work / "stopped").exists(), 120, "the bare query stopping")
        stop = float((work / "stopped").read_text())
        wait_for(lambda: jobs.refresh(settings, cluster, form).state == "FINISHED", 120, "the bare script ending")
    else:
        asked = time.perf_counter()
        savepoints.request_stop(settings, form, reason="benchmark")
        wait_for(lambda: jobs.refresh(settings, cluster, form).state == "STOPPED", 120, "the Changeover job stopping",
                 interval=0.05)
        stop = time.perf_counter() - asked
    generator.stop()
    return {"throughput": throughput, "interval": interval, "stop": stop, "seconds": time.time() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backlog", type=int, default=400, help="files of 40 events waiting at the start")
    parser.add_argument("--seconds", type=float, default=60, help="the steady phase's length")
    args = parser.parse_args()
    settings, _work = scratch_settings("overhead")
    cluster = membership_for(settings)
    try:
        cluster.up([("m1", "4.2.0")])
        results = {form: measure(settings, cluster, form, args.backlog, args.seconds)
                   for form in ("bare", "changeover")}
    finally:
        cluster.down()
    bare, under = results["bare"], results["changeover"]
    print(f"{'':32}{'bare':>12}{'changeover':>12}{'ratio':>8}")
    print(f"{'throughput at saturation (ev/s)':32}{bare['throughput']:>12.0f}{under['throughput']:>12.0f}"
          f"{under['throughput'] / bare['throughput']:>8.2f}")
    print(f"{'median commit interval (s)':32}{bare['interval']:>12.2f}{under['interval']:>12.2f}"
          f"{under['interval'] / bare['interval']:>8.2f}")
    print(f"{'stop latency (s)':32}{bare['stop']:>12.2f}{under['stop']:>12.2f}")


if __name__ == "__main__":
    main()
