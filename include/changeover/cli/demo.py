"""`make demo`: a live stateful job rolled through a real rolling Spark upgrade, driven by Airflow."""

from __future__ import annotations

import shutil
import signal
import sys
import time
from dataclasses import replace
from typing import Any

from jobs import clicks
from rich.console import Console
from sqlalchemy import select

from changeover import jobs
from changeover.cli import local_airflow, progress
from changeover.cli.generator import Generator
from changeover.cluster import Membership, membership_for, wait_for
from changeover.cluster.runtimes import find_runtime, java_home
from changeover.jobs import move_history
from changeover.registry.db import forget_engines, session_scope
from changeover.registry.models import Event, JobRun
from changeover.registry.schema import migrate
from changeover.registry.states import RunState
from changeover.settings import Settings
from changeover.timeutil import as_utc
from changeover.upgrade import verify

FROM_VERSION, TO_VERSION = "4.2.0", "4.3.0"
MEMBERS = ["m1", "m2", "m3"]
console = Console(soft_wrap=True)


def run_demo(keep_airflow: bool = False) -> int:
    started = time.monotonic()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` stops the Airflow and Spark it started
    # the embedded default, whatever cluster file the shell names: the demo starts and stops its own cluster
    settings = replace(Settings.from_env(), cluster_file=None)
    java_home()
    for version in (FROM_VERSION, TO_VERSION):
        find_runtime(settings.runtimes_dir, version)
    cluster = membership_for(settings)
    cluster.down()  # leftovers of an earlier demo in this folder
    shutil.rmtree(settings.home, ignore_errors=True)
    forget_engines()
    migrate(settings.database_url)
    generator = Generator(settings.data_dir / "landing")
    airflow: local_airflow.Standalone | None = None
    try:
        console.rule("1. Airflow: api-server, scheduler, dag-processor and triggerer, in the background")
        env = local_airflow.airflow_env(settings)
        local_airflow.migrate_airflow(env)
        airflow = local_airflow.Standalone(env, settings.home / "airflow-standalone.log").start()
        console.print(f"  UI: {airflow.url}  login: admin / {airflow.password}  (logs: {airflow.home}/logs)")
        console.rule("2. cluster: three members at Spark 4.2.0")
        cluster.up([(m, FROM_VERSION) for m in MEMBERS])
        generator.write_file()
        generator.start(interval=0.5)
        console.rule("3. jobs: a stateful stream, a block_shutdown batch job, an ad-hoc job")
        _submit_jobs(settings, cluster, generator)
        console.rule(f"4. rolling_upgrade to {TO_VERSION}, triggered as the UI does; its plan:")
        for line in verify.preflight(settings, cluster, TO_VERSION, MEMBERS, "demo", dry_run=True).moves.describe():
            console.print(f"  {line}")
        conf = {"target_version": TO_VERSION, "members": MEMBERS, "shutdown_timeout": 30}
        run_id = airflow.trigger("rolling_upgrade", conf)
        console.print(f"  run {run_id}: watch it at {airflow.url}/dags/rolling_upgrade/runs/{run_id}")
        state = airflow.follow("rolling_upgrade", run_id, timeout=1800, on_change=_print_task,
                               on_poll=progress.ChangePrinter(settings, f"rolling_upgrade/{run_id}",
                                                              lambda line: console.print(line, markup=False)))
        if state != "success":
            console.print(f"[red]rolling_upgrade ended {state}; task logs under {airflow.home}/logs")
            return 1
        console.rule("5. catch up and verify")
        generator.stop()
        wait_for(lambda: clicks.results(settings.database_url, "clicks")[0] == dict(generator.truth), 300,
                 "the clicks job catching up with every file the generator wrote")
        return _summary(settings, cluster, generator, time.monotonic() - started)
    finally:
        generator.stop()
        if airflow is not None and keep_airflow:
            console.print(f"Airflow keeps running at {airflow.url} (admin / {airflow.password}); "
                          f"stop it with: kill -- -{airflow.started.pid if airflow.started else '?'}")
        elif airflow is not None:
            airflow.stop()
            console.print("stopped Airflow")
        stopped = cluster.down()
        console.print(f"stopped {len(stopped)} Spark processes: {', '.join(stopped)}")


def _submit_jobs(settings: Settings, cluster: Membership, generator: Generator) -> None:
    """The demo's three jobs, each running (the stream with a committed batch), then listed."""
    jobs.submit(settings, cluster, "jobs.clicks", "clicks",
                options={"landing": str(generator.landing), "trigger": "1 second"})
    jobs.wait_until_committed(settings, cluster, "clicks")
    jobs.submit(settings, cluster, "jobs.nightly_report", "nightly_report", fault_tolerant=False,
                block_shutdown=True, options={"duration_seconds": 90})
    jobs.submit(settings, cluster, "jobs.adhoc_scan", "adhoc_scan", fault_tolerant=False, shutdown_timeout=10)
    wait_for(lambda: all(_placed(settings, cluster, j) for j in ("nightly_report", "adhoc_scan")), 240,
             "the batch jobs starting")
    for row in jobs.list_jobs(settings):
        console.print(f"  {row['name']:<15} {row['state']:<9} on {row['member']} at Spark {row['version']}")


def _print_task(ti: dict[str, Any]) -> None:
    console.print(f"  {ti['task_id']:<10} {ti['state'] or 'none':<10} try {ti['try_number']}")


def _run(settings: Settings, cluster: Membership, job: str) -> JobRun:
    run = jobs.refresh(settings, cluster, job)
    assert run is not None
    if run.state in ("FAILED", "KILLED"):
        raise RuntimeError(f"job {job} ended as {run.state}: {run.error}")
    return run


def _placed(settings: Settings, cluster: Membership, job: str) -> bool:
    run = _run(settings, cluster, job)
    return run.state == RunState.RUNNING and run.member is not None


def _summary(settings: Settings, cluster: Membership, generator: Generator, wall: float) -> int:
    status = cluster.status()
    with session_scope(settings.database_url) as s:
        events = list(s.scalars(select(Event).order_by(Event.id)))
    console.rule("summary")
    upgrades = {e.subject: e.details for e in events if e.action == "member.upgrade"}
    for m in status["members"]:
        old = upgrades.get(m["name"], {}).get("from_version", m["version"])
        console.print(f"member {m['name']}: {old} -> {m['version']}")
    for sp in [e for e in events if e.action == "savepoint.create"]:
        console.print(f"savepoint {sp.subject}: {sp.details['size_bytes']:,} bytes, batches {sp.details['stages']}")
    for line in _drain_outcomes(events):
        console.print(line)
    downtimes: list[float] = []
    for row in jobs.list_jobs(settings):
        made = move_history.of(settings, row["name"])
        for move in made:
            console.print(f"  {move.describe()}")
        downtimes += [m.downtime for m in made if m.downtime is not None]
        console.print(f"job {row['name']}: {len(made)} move{'s' if len(made) != 1 else ''}, now {row['state']}")
    console.print(f"downtime total {sum(downtimes):.1f} s over every move, longest {max(downtimes, default=0):.1f} s")
    console.print(f"total wall time: {wall:.0f} s")
    totals, windows = clicks.results(settings.database_url, "clicks")
    wrong_windows = {k: v for k, v in windows.items() if generator.window_truth.get(k) != v}
    truth = dict(generator.truth)
    missing = sorted(set(truth) - set(totals))
    off = {k: (totals.get(k), truth[k]) for k in truth if totals.get(k) != truth[k]}
    ok = not off and not missing and not wrong_windows and set(totals) == set(truth)
    verdict = "[green]VERIFIED[/]" if ok else "[red]MISMATCH[/]"
    console.print(
        f"{verdict}: {len(truth)} keys, {sum(totals.values()):,} of {sum(truth.values()):,} events from "
        f"{generator.files} files counted exactly once; {len(windows)} closed windows match ground truth"
        + ("" if ok else f"; wrong totals {off}, missing {missing}, wrong windows {wrong_windows}")
    )
    return 0 if ok else 1


def _drain_outcomes(events: list[Event]) -> list[str]:
    lines: list[str] = []
    decided: dict[str, tuple[str, Any]] = {}
    for e in events:
        if e.action.startswith("drain.decide."):
            decided[e.subject] = (e.action.rsplit(".", 1)[1], e)
    ends = {e.subject: e for e in events if e.action in ("job.end", "job.stop", "job.cancel")}
    for job, (action, e) in decided.items():
        member = e.details["member"]
        if action == "save":
            lines.append(f"drain {member}: job {job} saved with a savepoint and resumed elsewhere")
        elif action == "wait":
            end = ends.get(job)
            waited = (as_utc(end.at) - as_utc(e.at)).total_seconds() if end else float("nan")
            lines.append(f"drain {member}: job {job} (block_shutdown) waited for {waited:.0f} s until it finished")
        else:
            end = ends.get(job)
            how = "cancelled after its shutdown timeout" if end and end.action == "job.cancel" else "finished in time"
            lines.append(f"drain {member}: job {job} {how}")
    return lines
