"""Does a `continue` savepoint slow the running job? Commit intervals with and without savepoints.

Runs the demo's `clicks` job on a one-member local cluster, fed by the generator, and reads batch
completion times from the mtimes of its checkpoint's commit files. Phase one runs undisturbed;
phase two takes a `continue` savepoint every --every seconds. Prints both phases side by side.

    .venv/bin/python bench/savepoint_latency.py [--seconds 60] [--every 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from changeover import jobs, savepoints
from changeover.cli.generator import Generator
from changeover.cluster import membership_for
from scratch import scratch_settings


def commit_times(stage: Path, since: float, until: float) -> list[float]:
    times = sorted(p.stat().st_mtime for p in (stage / "commits").iterdir() if p.name.isdigit())
    return [t for t in times if since <= t <= until]


def intervals(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--every", type=float, default=5)
    args = parser.parse_args()
    settings, _work = scratch_settings("latency")
    cluster = membership_for(settings)
    generator = Generator(settings.data_dir / "landing")
    try:
        cluster.up([("m1", "4.2.0")])
        generator.write_file()
        generator.start(interval=0.5)
        run = jobs.submit(settings, cluster, "jobs.clicks", "clicks",
                          options={"landing": str(generator.landing), "trigger": "1 second"})
        jobs.wait_until_committed(settings, cluster, "clicks")
        stage = Path(run.checkpoint_root or "") / "totals"
        time.sleep(10)  # let the first, cold batches pass before measuring
        quiet_start = time.time()
        time.sleep(args.seconds)
        quiet_end = busy_start = time.time()
        taken, costs = 0, []
        while time.time() - busy_start < args.seconds:
            started = time.perf_counter()
            savepoints.take(settings, "clicks", f"bench-{taken}", mode="continue")
            costs.append(time.perf_counter() - started)
            taken += 1
            time.sleep(args.every)
        busy_end = time.time()
        quiet = intervals(commit_times(stage, quiet_start, quiet_end))
        busy = intervals(commit_times(stage, busy_start, busy_end))
        print(f"{'phase':<22} {'batches':>8} {'median gap':>11} {'p90 gap':>8} {'max gap':>8}")
        for name, gaps in (("no savepoints", quiet), (f"savepoint every {args.every:.0f} s", busy)):
            p90 = statistics.quantiles(gaps, n=10)[-1] if len(gaps) >= 10 else max(gaps)
            print(f"{name:<22} {len(gaps) + 1:>8} {statistics.median(gaps):>10.2f}s {p90:>7.2f}s {max(gaps):>7.2f}s")
        print(f"{taken} savepoints, median {statistics.median(costs) * 1000:.0f} ms each; trigger interval 1 s")
    finally:
        generator.stop()
        cluster.down()


if __name__ == "__main__":
    main()
