"""How fast the `changeover` command answers: its help, and a light SQL job from a new process.

Times, each over --runs runs after one unmeasured run, and prints the median (with the fastest and slowest):
  - `changeover --help` and a few commands' `--help`, each a new process (the console script, as a shell runs it);
  - `changeover sql 'SELECT 1'`, a new process each time, against an idle local cluster with a Spark Connect server
    per member (`cluster up --light-jobs`), in a private home started and stopped with the CLI itself: the first
    one (it starts the SQL agent), then through the running agent, then with --no-agent (a session of its own);
  - beside them, in this process, the same statement as a light job with a pooled session
    (`changeover.light.session(reuse=True)`) and with a new session each time (`reuse=False`),
and the ratios of the new processes to the pooled session.

    .venv/bin/python bench/cli.py [--runs 5] [--members m1,m2] [--help-only]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]
CHANGEOVER = str(Path(sys.executable).parent / "changeover")
SQL = "SELECT 1"
HELPS = [["--help"], ["submit", "--help"], ["sql", "--help"], ["upgrade", "status", "--help"]]


def timed(work: Callable[[], object], runs: int, warm: int = 1) -> list[float]:
    for _ in range(warm):  # unmeasured: file caches, each server's first plan
        work()
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        work()
        times.append(time.perf_counter() - began)
    return times


def show(what: str, times: list[float]) -> float:
    median = statistics.median(times)
    print(f"{what:56} n={len(times):<3} median {median:7.3f} s  (min {min(times):.3f}, max {max(times):.3f})",
          flush=True)
    return median


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([CHANGEOVER, *args], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"changeover {' '.join(args)} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    return done


def helps(runs: int) -> None:
    env = {**os.environ, "COLUMNS": "80"}
    for args in HELPS:
        show(f"changeover {' '.join(args)}", timed(lambda args=args: cli(env, *args), runs))


def sql(runs: int, members: str) -> None:
    import warnings

    warnings.filterwarnings("ignore", message="PySpark does not yet fully support pandas", category=FutureWarning)
    from changeover import light
    from changeover.settings import Settings

    base = CHECKOUT / ".changeover" / "bench"
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="cli-", dir=base))
    settings = Settings.from_env(home=work / "home", database_url=f"sqlite:///{work / 'registry.db'}")
    # CHANGEOVER_SQL_AGENT=1: the agent also when this runs without a terminal (nohup, CI), which otherwise starts none
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("CHANGEOVER_")}, **settings.as_env(),
           "COLUMNS": "80", "CHANGEOVER_SQL_AGENT": "1"}
    cli(env, "db", "upgrade")
    try:
        cli(env, "cluster", "up", "--members", members, "--light-jobs")
        began = time.perf_counter()
        cli(env, "sql", SQL)
        show(f"changeover sql '{SQL}', the first (starts the agent)", [time.perf_counter() - began])
        # warm: routing picks a member at random, and each Connect server's first statement is slow
        agent = show(f"changeover sql '{SQL}' (a new process each)", timed(lambda: cli(env, "sql", SQL), runs, 6))
        alone = show(f"changeover sql --no-agent '{SQL}'", timed(lambda: cli(env, "sql", "--no-agent", SQL), runs))

        def in_process(reuse: bool) -> None:
            with light.session(settings, statement=SQL, reuse=reuse) as job:
                assert job.spark.sql(SQL).collect()[0][0] == 1

        pooled = show("in process, light.session(reuse=True)", timed(lambda: in_process(True), runs))
        show("in process, light.session(reuse=False)", timed(lambda: in_process(False), runs))
        light.close_pool()
        print(f"new process / pooled session (medians): {agent / pooled:.1f}x through the agent, "
              f"{alone / pooled:.1f}x with --no-agent")
    finally:
        print(cli(env, "cluster", "down").stdout.strip())  # the agent stops with it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--members", default="m1,m2")
    parser.add_argument("--help-only", action="store_true", help="Skip the cluster and the SQL.")
    args = parser.parse_args()
    helps(args.runs)
    if not args.help_only:
        sql(args.runs, args.members)


if __name__ == "__main__":
    main()
