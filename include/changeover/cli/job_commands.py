"""`changeover jobs`, `submit` and `check`: the jobs, a job's launch, and new code checked against a savepoint."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from changeover.cli.app import JsonFlag, app, checked_settings, emit, out
from changeover.errors import ChangeoverError


@app.command("jobs")
def list_jobs(as_json: JsonFlag = False) -> None:
    """Jobs with their current run: state, version and member."""
    from changeover import jobs
    from changeover.cluster import membership_for

    settings = checked_settings()
    jobs.refresh_all(settings, membership_for(settings))
    emit(jobs.list_jobs(settings), as_json, [("NAME", "name"), ("STATE", "state"), ("VERSION", "version"),
                                             ("MEMBER", "member"), ("RUN", "run"), ("PROGRESS", "progress"),
                                             ("STANDBY", "standby")])


def _pairs(items: list[str] | None, what: str) -> dict[str, str]:
    pairs = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ChangeoverError(f"{what} {item!r}", "it is not of the form KEY=VALUE", f"write it as {what} A=B")
        pairs[key] = value
    return pairs


@app.command("submit")
def submit(
    code: Annotated[str, typer.Argument(help="The job's .py file or package folder, anywhere (or a module "
                                             "such as jobs.clicks). Frozen and shipped with every launch.")],
    name: Annotated[str, typer.Option("--name", help="Job name.")],
    from_savepoint: Annotated[str | None, typer.Option(
        "--from-savepoint", help="NAME, or JOB/NAME for another job's savepoint.")] = None,
    rename_stage: Annotated[list[str] | None, typer.Option(
        "--rename-stage", help="OLD=NEW: restore the savepoint's stage OLD into the job's stage NEW.")] = None,
    allow_non_restored_state: Annotated[bool, typer.Option(
        "--allow-non-restored-state", help="Drop state of stages the job no longer has.")] = False,
    rewind_sink: Annotated[bool, typer.Option(
        "--rewind-sink", help="Resuming an older savepoint: make the sinks as they were at its batch.")] = False,
    accept_duplicates: Annotated[bool, typer.Option(
        "--accept-duplicates", help="Resuming an older savepoint: let at-least-once sinks get batches twice.")] = False,
    state_partitions: Annotated[int | None, typer.Option(
        "--state-partitions", help="With --from-savepoint: repartition the restored state to this many partitions "
                                   "(RocksDB store, Spark 4.2+; check first with `changeover check`).")] = None,
    fault_tolerant: Annotated[bool, typer.Option(
        "--fault-tolerant/--no-fault-tolerant",
        help="A drain saves the job with a savepoint and resumes it on another member; else it waits or cancels.",
    )] = True,
    block_shutdown: Annotated[bool, typer.Option(
        "--block-shutdown", help="Not fault-tolerant: a drain waits for the job to end rather than cancel it after "
                                 "--shutdown-timeout.")] = False,
    shutdown_timeout: Annotated[int, typer.Option(help="Seconds a drain waits before cancelling.")] = 30,
    option: Annotated[list[str] | None, typer.Option("--option", help="Job option KEY=VALUE.")] = None,
    executor_cores: Annotated[int, typer.Option(help="Cores per executor.")] = 1,
    executor_memory: Annotated[str, typer.Option(help="Memory per executor, e.g. 2g.")] = "1g",
    driver_memory: Annotated[str, typer.Option(help="The driver's memory, e.g. 2g.")] = "1g",
    cores_max: Annotated[int | None, typer.Option(help="Cores of the whole job (default: one executor's).")] = None,
    shuffle_partitions: Annotated[int, typer.Option(help="spark.sql.shuffle.partitions.")] = 4,
    conf: Annotated[list[str] | None, typer.Option("--conf", help="Spark conf KEY=VALUE.")] = None,
    py_files: Annotated[list[str] | None, typer.Option("--py-files", help="More Python files or zips.")] = None,
    jars: Annotated[list[str] | None, typer.Option("--jars", help="Jars for driver and executors.")] = None,
    packages: Annotated[list[str] | None, typer.Option("--packages", help="Maven coordinates.")] = None,
) -> None:
    """Submit a job to the largest version group, optionally from a savepoint."""
    from dataclasses import asdict

    from changeover import jobs
    from changeover.cluster import membership_for
    from changeover.cluster.spark_settings import SparkSettings

    settings = checked_settings()
    spark = SparkSettings(executor_cores, executor_memory, driver_memory, cores_max, shuffle_partitions,
                          _pairs(conf, "--conf"), tuple(py_files or ()), tuple(jars or ()), tuple(packages or ()))
    spark.check()
    options: dict[str, Any] = {**_pairs(option, "--option"), "spark": asdict(spark)}
    run = jobs.submit(settings, membership_for(settings), code, name, fault_tolerant=fault_tolerant,
                      block_shutdown=block_shutdown, shutdown_timeout=shutdown_timeout,
                      options=options, from_savepoint=from_savepoint,
                      rename_stages=_pairs(rename_stage, "--rename-stage"),
                      allow_non_restored_state=allow_non_restored_state, rewind_sink=rewind_sink,
                      accept_duplicates=accept_duplicates, state_partitions=state_partitions)
    out().print(f"job {name}: run {run.id} submitted to Spark {run.spark_version} as {run.submission_id}")


@app.command("check")
def check(
    code: Annotated[str, typer.Argument(help="The job's new .py file or package folder (or a module).")],
    savepoint: Annotated[str, typer.Option("--savepoint", help="JOB/NAME: the savepoint the code would resume.")],
    target_version: Annotated[str | None, typer.Option(
        "--target-version", help="The Spark version to resume on (default: the savepoint's).")] = None,
    rename_stage: Annotated[list[str] | None, typer.Option(
        "--rename-stage", help="OLD=NEW: the savepoint's stage OLD is the code's stage NEW.")] = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Also replay a batch of each restored stage on the target runtime, from scratch "
                          "copies of the savepoint, with the sink's writes suppressed.")] = False,
    dry_run_timeout: Annotated[float, typer.Option(help="Seconds each replayed batch may take.")] = 180,
    strict: Annotated[bool, typer.Option(
        "--strict", help="Refuse stage names that look generated (stage_0, a hex id) rather than chosen.")] = False,
    state_partitions: Annotated[int | None, typer.Option(
        "--state-partitions", help="Also check that each stage's state can move to this many partitions; the dry "
                                   "run then replays on a repartitioned copy.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Compare new code with a savepoint, before anything running is touched. Exit code: 0 COMPATIBLE,
    10 COMPATIBLE_WITH_WARNING, 20 NEEDS_DISCARD, 30 INCOMPATIBLE (2: the check itself could not run)."""
    from changeover.compat.static_check import check_code

    report = check_code(checked_settings(), code, savepoint, target_version, _pairs(rename_stage, "--rename-stage"),
                        dry_run=dry_run, strict=strict, dry_run_timeout=dry_run_timeout,
                        state_partitions=state_partitions)
    if as_json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        out().print(report.render(), soft_wrap=True)
    raise typer.Exit(int(report.verdict))
