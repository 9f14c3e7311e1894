"""What a move costs a job: downtime from the old run's last commit to the new run's first commit.

One run measures, on the same stateful query (bench/jobs: 10 s windowed counts into parquet) and the same input
(a generator writing one file of 40 events every 0.5 s, the same seed each time), on one local cluster
(m1, m2 at Spark 4.2.0, m3 at 4.3.0):

  (a) the bare query, an unchanged PySpark script, stopped and started again in a new process on 4.3.0 from its
      own checkpoint: the floor of a cold restart;
  (b) Changeover's cold move to 4.3.0 (the job's option warm_moves off: stop, savepoint, launch, first batch);
  (c) Changeover's warm move to 4.3.0 (a standby started and ready on 4.3.0 before the stop);
  (e) Changeover's zero-downtime move to 4.3.0 (the standby follows the job read-only from a continue savepoint
      until it has caught up; the job parks and the follower writes from the next batch);
  (d) a whole rolling_upgrade of three members (all at 4.2.0) to 4.3.0 through Airflow (`airflow standalone`:
      scheduler, executor, triggerer, triggered as the UI does), the job's number of moves and the sum of its
      downtimes, beside each member's time back in service and a worker's cold start in the same run.

Commit times are the commit files' times in the checkpoints, for all forms alike. Beside each move's downtime, the
job's own usual time between commits before it (the median over its last 10 batches), the gap with no move at all.
(b) to (e) end exact:
every window the generator closed is in the output, once, with its true count.

    PYTHONPATH=bench .venv/bin/python bench/downtime.py [--only a,b,c,d,e] [--stages 2] [--trigger '3 seconds']

--stages and --trigger apply to (b), (c) and (e): a job of several queries (as the demo's clicks, 2), and another
interval; with several stages a move's downtime is its longest stage's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from changeover import jobs
from changeover.cli import local_airflow
from changeover.cli.generator import EPOCH, Generator
from changeover.cluster import Membership, membership_for, wait_for
from changeover.cluster.spark_settings import SparkSettings
from changeover.errors import ChangeoverError
from changeover.jobs import move_history
from changeover.registry.db import session_scope
from changeover.registry.models import Event, JobRun
from changeover.runtime.sinks.files import LOG, log_entries
from changeover.settings import Settings
from changeover.timeutil import as_utc
from changeover.upgrade import relocate
from runtime_overhead import commits
from scratch import scratch_settings
from sqlalchemy import select

JOBS = Path(__file__).resolve().parent / "jobs"
sys.path.append(str(JOBS))
from window_query import TRIGGER, stage_outputs  # noqa: E402 - the job's own module, shipped to its driver

SPARK = asdict(SparkSettings(py_files=(str(JOBS / "window_query.py"),)))
WINDOW = timedelta(seconds=10)
WARM_UP_SECONDS = 20.0  # the job runs steadily this long before it is moved (a measurement window)


def commit_times(checkpoint: Path) -> dict[int, float]:
    return dict(commits(checkpoint))


def gap(before: Path, after: Path, last: int) -> float:
    """From batch `last`'s commit in `before` to the first later batch's commit in `after`."""
    later = {b: t for b, t in commit_times(after).items() if b > last}
    return later[min(later)] - commit_times(before)[last]


def output_counts(output: Path) -> Counter[str]:
    counts: Counter[str] = Counter()
    for path in log_entries(output / LOG):
        for row in pq.read_table(path).to_pylist():
            key = f"{row['key']}@{row['window']['start']:%Y-%m-%d %H:%M:%S}"
            assert key not in counts, f"window {key} written twice"
            counts[key] = row["count"]
    return counts


def exact(generator: Generator, *outputs: Path) -> bool:
    """In each output, every window the watermark has closed is there once, with its true count, and nothing else."""
    generator.stop()
    for _ in range(30):  # event time moves 30 s on: the watermark (10 s) passes every window written before
        generator.write_file()
    horizon = EPOCH + timedelta(seconds=generator.files - 25)
    closed = {k: v for k, v in generator.window_truth.items()
              if datetime.strptime(k.split("@")[1], "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC) + WINDOW <= horizon}
    try:
        for output in outputs:
            wait_for(lambda output=output: {k: v for k, v in output_counts(output).items() if k in closed} == closed,
                     180, f"every closed window in {output}")
    except ChangeoverError:
        return False
    return all(generator.window_truth.get(k) == v for output in outputs for k, v in output_counts(output).items())


def bare(settings: Settings, cluster: Membership) -> dict[str, float]:
    """(a): the script stopped on 4.2.0 and started again on 4.3.0, from its own checkpoint."""
    work = settings.home / "bare"
    generator = Generator(work / "landing", seed=11)
    checkpoint = work / "checkpoint"
    config = {"landing": str(generator.landing), "output": str(work / "output"), "checkpoint": str(checkpoint),
              "stop_file": str(work / "stop"), "stopped_file": str(work / "stopped")}
    (settings.home / "bench-bare.json").write_text(json.dumps(config))
    generator.write_file()
    generator.start(interval=0.5)
    try:
        jobs.submit(settings, cluster, str(JOBS / "window_counts_bare.py"), "bare", fault_tolerant=False,
                    options={"spark": SPARK})
        wait_for(lambda: len(commit_times(checkpoint)) >= 2, 300, "the bare query committing")
        time.sleep(WARM_UP_SECONDS)  # a measurement window, not a synchronisation
        (work / "stop").touch()
        wait_for(lambda: (work / "stopped").exists(), 120, "the bare query stopping", interval=0.02)
        last = max(commit_times(checkpoint))
        (work / "stop").unlink()
        (work / "stopped").unlink()
        jobs.launch(settings, cluster, "bare", "4.3.0", None)
        wait_for(lambda: max(commit_times(checkpoint)) > last, 300, "the bare query's first commit on 4.3.0",
                 interval=0.05)
        return {"downtime": gap(checkpoint, checkpoint, last)}
    finally:
        generator.stop()
        (work / "stop").touch()
        wait_for(lambda: jobs.refresh(settings, cluster, "bare").state not in jobs.LIVE, 120, "the bare script ending")


def start_job(settings: Settings, cluster: Membership, name: str, warm: bool = True,
              stages: int = 1, trigger: str = TRIGGER) -> tuple[Generator, JobRun]:
    """The measured job under Changeover, with its generator writing (the same seed for every form)."""
    work = settings.home / name
    generator = Generator(work / "landing", seed=11)
    generator.write_file()
    generator.start(interval=0.5)
    try:
        run = jobs.submit(settings, cluster, str(JOBS / "window_counts.py"), name,
                          options={"landing": str(generator.landing), "output": str(work / "output"),
                                   "spark": SPARK, "warm_moves": warm, "stages": stages,
                                   "trigger": trigger})
        jobs.wait_until_committed(settings, cluster, name)
    except BaseException:
        generator.stop()
        raise
    return generator, run


def first_commit_gap(before: Path, after: Path, what: str) -> float:
    """From the last commit in `before` (a run that has stopped) to the first later one in `after`."""
    last = max(commit_times(before))
    wait_for(lambda: any(b > last for b in commit_times(after)), 300, f"{what}'s first commit", interval=0.05)
    return gap(before, after, last)


def usual_gap(checkpoint: Path, batches: int = 10) -> float:
    """The median time between the job's own consecutive commits over its last `batches` before the move, with no
    move: the baseline beside each move's downtime. At a fixed trigger a downtime cannot go much below it, as the new
    run's next batch waits for its trigger like the old run's would have."""
    times = [t for _, t in sorted(commit_times(checkpoint).items())][-(batches + 1):]
    gaps = sorted(later - earlier for earlier, later in zip(times, times[1:], strict=False))
    return gaps[len(gaps) // 2]


def counts_checkpoint(settings: Settings, run_id: int, stage: str = "counts") -> Path:
    with session_scope(settings.database_url) as s:
        run = s.get(JobRun, run_id)
        assert run is not None and run.checkpoint_root
        return Path(run.checkpoint_root) / stage


def changeover_move(settings: Settings, cluster: Membership, name: str, warm: bool,
                    strategy: str = "warm", stages: int = 1, trigger: str = TRIGGER) -> dict[str, Any]:
    """(b), (c) or (e): the job under Changeover, moved from 4.2.0 to 4.3.0 one step at a time, as a drain moves it.
    With several stages, the job's downtime is its longest stage's."""
    outputs = stage_outputs(str(settings.home / name / "output"), stages)
    generator, run = start_job(settings, cluster, name, warm, stages, trigger)
    try:
        before = counts_checkpoint(settings, run.id)
        time.sleep(WARM_UP_SECONDS)  # a measurement window, not a synchronisation
        started = time.monotonic()
        # a step every second, as a drain's poll would be (Airflow's is slower): a step that finds the successor
        # ready does the stop and the hand-over itself, so the downtime does not wait on this interval, and a faster
        # loop only takes the cores the job and its follower need (at 0.1 s it took a third of one)
        wait_for(lambda: relocate.step(settings, cluster, name, "4.3.0", reason="bench", strategy=strategy), 600,
                 f"{name} moving to 4.3.0", interval=1.0)
        moved = time.monotonic() - started
        after_run = jobs.refresh(settings, cluster, name)
        if after_run is None or after_run.spark_version != "4.3.0":  # moved elsewhere, or its move undone
            raise ChangeoverError(f"the benchmark's move of {name}", "the job is still on 4.2.0: its move was "
                                  "not completed (`changeover events --job " + name + "` says why)",
                                  "run it again on a quieter machine")
        downtime = max(first_commit_gap(counts_checkpoint(settings, run.id, stage),
                                        counts_checkpoint(settings, after_run.id, stage), f"{name} {stage} on 4.3.0")
                       for stage in outputs)
        return {"downtime": downtime, "warm": after_run.standby_of is not None, "orchestration": moved,
                "usual_gap": usual_gap(before), "exact": exact(generator, *map(Path, outputs.values()))}
    finally:
        generator.stop()
        jobs.cancel(settings, cluster, name, reason="benchmark done")


def rolling_upgrade(settings: Settings, work: Path) -> dict[str, Any]:
    """(d): the three members of a 4.2.0 cluster rolled to 4.3.0 by the rolling_upgrade DAG, through Airflow."""
    cluster = membership_for(settings)
    env = local_airflow.airflow_env(settings, airflow_home=work / "airflow")
    (work / "airflow").mkdir(parents=True, exist_ok=True)
    local_airflow.migrate_airflow(env)
    airflow = local_airflow.Standalone(env, work / "airflow-standalone.log")
    generator: Generator | None = None
    try:
        airflow.start()
        cluster.up([("m1", "4.2.0"), ("m2", "4.2.0"), ("m3", "4.2.0")])
        generator, run = start_job(settings, cluster, "rolled")
        time.sleep(WARM_UP_SECONDS)  # a measurement window, not a synchronisation
        run_id = airflow.trigger("rolling_upgrade", {"target_version": "4.3.0", "members": [],
                                                     "shutdown_timeout": 30})
        state = airflow.follow("rolling_upgrade", run_id, timeout=2400)
        if state != "success":
            raise ChangeoverError("the benchmark's rolling_upgrade", f"its DAG run {run_id} ended {state}",
                                  f"read the task logs under {airflow.home}/logs")
        made = move_history.of(settings, "rolled")
        gaps = []
        for move in made:
            before, after = counts_checkpoint(settings, move.from_run), counts_checkpoint(settings, move.to_run)
            gaps.append(first_commit_gap(before, after, f"run {move.to_run}"))
        return {"moves": len(made), "warm": [m.warm for m in made], "downtimes": gaps, "downtime": sum(gaps),
                "exact": exact(generator, settings.home / "rolled" / "output"), **member_times(settings)}
    finally:
        if generator is not None:
            generator.stop()
        airflow.stop()
        cluster.down()


def member_times(settings: Settings) -> dict[str, Any]:
    """A worker's cold start (the cluster's start) and each member's time back in service during the upgrade:
    from its upgrade's start (drained) to its worker registered at the new version."""
    with session_scope(settings.database_url) as s:
        events = list(s.scalars(select(Event).where(Event.subject_kind == "member").order_by(Event.id)))
    began = {e.subject: as_utc(e.at) for e in events if e.action == "member.upgrade.begin"}
    first = min((e.id for e in events if e.action == "member.upgrade.begin"), default=1 << 62)
    cold = [e.details["seconds"] for e in events if e.action == "member.start" and e.id < first]
    back, parts = {}, {}
    for e in events:
        if e.action == "member.upgrade" and e.subject in began:
            back[e.subject] = (as_utc(e.at) - began[e.subject]).total_seconds()
        if e.subject in began and as_utc(e.at) >= began[e.subject] and e.action in ("member.stop", "member.start"):
            parts.setdefault(e.subject, {})[e.action.split(".")[1]] = e.details["seconds"]
    return {"cold_start": cold, "back_in_service": back, "restart_parts": parts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="a,b,c,d,e", help="which forms to run, e.g. a,d (the ratios need a)")
    parser.add_argument("--stages", type=int, default=1, help="the job's stages in (b), (c) and (e): each a query "
                        "of its own, as the demo's clicks has 2")
    parser.add_argument("--trigger", default=TRIGGER, help="the job's trigger interval in (b), (c) and (e)")
    args = parser.parse_args()
    forms, stages, trigger = set(args.only.split(",")), args.stages, args.trigger
    settings, _work = scratch_settings("downtime")
    cluster = membership_for(settings)
    results: dict[str, dict[str, Any]] = {}
    failed: dict[str, Exception] = {}

    def measure(form: str, how: Callable[[], dict[str, Any]]) -> None:
        if form in forms:
            try:
                results[form] = how()
            except (ChangeoverError, AssertionError, TimeoutError) as exc:  # the others are still reported
                failed[form] = exc

    try:
        cluster.up([("m1", "4.2.0"), ("m2", "4.2.0"), ("m3", "4.3.0")])
        measure("a", lambda: bare(settings, cluster))
        measure("b", lambda: changeover_move(settings, cluster, "cold", False, "warm", stages, trigger))
        measure("c", lambda: changeover_move(settings, cluster, "warm", True, "warm", stages, trigger))
        measure("e", lambda: changeover_move(settings, cluster, "zerodowntime", True, "zero_downtime", stages, trigger))
    finally:
        cluster.down()
    if "d" in forms:
        rolled_settings, rolled_work = scratch_settings("downtime-rolling")
        measure("d", lambda: rolling_upgrade(rolled_settings, rolled_work))
    report(results)
    if failed:
        raise SystemExit("\n".join(f"({form}) did not complete: {exc}" for form, exc in sorted(failed.items())))


def report(results: dict[str, dict[str, Any]]) -> None:
    floor = results["a"]["downtime"] if "a" in results else float("nan")
    print(f"{'':44}{'downtime (s)':>14}{'x (a)':>8}  notes")
    if "a" in results:
        print(f"{'(a) bare restart in a new process':44}{floor:>14.2f}{1:>8.2f}")
    for key, label in (("b", "(b) Changeover, cold move"), ("c", "(c) Changeover, warm move"),
                       ("e", "(e) Changeover, zero-downtime move")):
        if key in results:
            r = results[key]
            print(f"{label:44}{r['downtime']:>14.2f}{r['downtime'] / floor:>8.2f}  "
                  f"{'warm' if r['warm'] else 'cold'}, exact: {r['exact']}, move took {r['orchestration']:.1f} s; "
                  f"its commits {r['usual_gap']:.2f} s apart before the move ({r['downtime'] / r['usual_gap']:.2f}x)")
    if "d" in results:
        r = results["d"]
        kinds = ", ".join("warm" if w else "cold" for w in r["warm"])
        each = " + ".join(f"{g:.2f}" for g in r["downtimes"])
        label = "(d) rolling_upgrade of 3 members, Airflow"
        print(f"{label:44}{r['downtime']:>14.2f}{r['downtime'] / floor:>8.2f}  "
              f"{r['moves']} move(s) ({kinds}; {each} s), exact: {r['exact']}")
        cold = r["cold_start"]
        print(f"worker cold start at the cluster's start: {', '.join(f'{c:.1f}' for c in cold)} s")
        for member, seconds in sorted(r["back_in_service"].items()):
            parts = r["restart_parts"].get(member, {})
            print(f"member {member} back in service in {seconds:.1f} s ({seconds / max(cold):.2f}x the slowest cold "
                  f"start; worker stop {parts.get('stop', float('nan')):.1f} s, start "
                  f"{parts.get('start', float('nan')):.1f} s)")


if __name__ == "__main__":
    main()
