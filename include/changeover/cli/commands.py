"""The `changeover` command.

Only Typer and the standard library load with this module, so that `changeover --help` and every command's help
answer at once: each command imports what it uses (SQLAlchemy, Alembic, Rich's tables, Spark Connect, the core
packages) in its own body. Help is Click's plain layout (`rich_markup_mode=None`): it never cuts an option's name
in an 80-column terminal, as Rich's option table does, and it needs no Rich.
"""

from __future__ import annotations

import atexit
import functools
import gc
import json
import sys
import time
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer.core import TyperGroup

from changeover.errors import ChangeoverError

if TYPE_CHECKING:
    from rich.console import Console

    from changeover.settings import Settings


class _Group(TyperGroup):
    """Typer's group, where a flag not given reads False rather than None. Typer 0.29 coerces a None through a
    Pydantic adapter, and imports Pydantic to build it (about 0.35 s of CPU): a group's own --help and completion
    flags are read on every command line, so `changeover submit --help` paid that for nothing."""

    def get_params(self, ctx: Any) -> list[Any]:
        params = super().get_params(ctx)
        for param in params:
            if getattr(param, "is_flag", False) and param.default is None:
                param.default = False
        return params


def _typer(help: str, **kwargs: Any) -> typer.Typer:  # noqa: A002 - Typer's own name for it
    return typer.Typer(help=help, rich_markup_mode=None, cls=_Group, **kwargs)


app = _typer("Upgrade running PySpark jobs without losing their state.", no_args_is_help=True)
cluster_app = _typer("Start, stop and inspect the local Spark cluster.", no_args_is_help=True)
runtime_app = _typer("Spark runtimes, one per version.", no_args_is_help=True)
app.add_typer(cluster_app, name="cluster")
app.add_typer(runtime_app, name="runtime")
upgrades_app = _typer("Rolling upgrades: list them, release a stuck one.", invoke_without_command=True)
app.add_typer(upgrades_app, name="upgrades")
upgrade_app = _typer("One member's upgrade, and a failed upgrade's status, abort or resume.", no_args_is_help=True)
app.add_typer(upgrade_app, name="upgrade")
db_app = _typer("The registry's schema.", no_args_is_help=True)
app.add_typer(db_app, name="db")
maintenance_app = _typer("Members marked for the next drain window.", invoke_without_command=True)
app.add_typer(maintenance_app, name="maintenance")
light_app = _typer("Light jobs: SQL and DataFrames run through the members' Connect servers.", no_args_is_help=True)
app.add_typer(light_app, name="light")


@functools.cache
def _out() -> Console:
    """Rich's console, made (and Rich loaded) on a command's first print. Markup off: job code, paths and Spark's
    messages hold brackets that Rich would read as tags."""
    from rich.console import Console

    return Console(markup=False, highlight=False)


JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def _settings() -> Settings:
    """The registry as this code's schema has it; migrating is `db upgrade`'s alone, so that a newer CLI never moves
    a shared registry ahead of the Airflow workers that use it."""
    from changeover.registry.schema import require_current

    settings = _plain_settings()
    require_current(settings.database_url)
    return settings


def _plain_settings() -> Settings:
    """The settings alone, for the commands that need no registry or migrate it themselves."""
    from changeover.settings import Settings

    return Settings.from_env()


def _emit(rows: list[dict[str, Any]] | dict[str, Any], as_json: bool, columns: list[tuple[str, str]]) -> None:
    if as_json:
        print(json.dumps(rows, indent=2, default=str))
        return
    from rich.table import Table

    table = Table(*[title for title, _ in columns])
    for row in rows if isinstance(rows, list) else [rows]:
        table.add_row(*[f"{row[key]:,}" if isinstance(row[key], int) and not isinstance(row[key], bool)
                        else str(row[key]) for _, key in columns])
    _out().print(table)


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Bring the registry to this version's schema (Airflow's tasks refuse a registry that is not there)."""
    from sqlalchemy.engine import make_url

    from changeover.registry.schema import migrate

    settings = _plain_settings()
    migrate(settings.database_url)
    _out().print(f"registry schema current at {make_url(settings.database_url).render_as_string(hide_password=True)}")


@cluster_app.command("up")
def cluster_up(
    members: Annotated[str, typer.Option(help="Comma-separated member names.")] = "m1,m2,m3",
    version: Annotated[str, typer.Option(help="Spark version of the new members.")] = "4.2.0",
    master_port: Annotated[int | None, typer.Option(help="Port of a new master; free one if unset.")] = None,
    light_jobs: Annotated[bool, typer.Option("--light-jobs/--no-light-jobs",
                                             help="Each member also runs a Spark Connect server for light jobs "
                                                  "(`changeover sql`).")] = False,
) -> None:
    """Start a master per version group and a worker per member."""
    from changeover.cluster import membership_for

    specs = [(name.strip(), version) for name in members.split(",") if name.strip()]
    membership_for(_settings()).up(specs, master_port, light_jobs=light_jobs)
    cluster_status(as_json=False)


@cluster_app.command("down")
def cluster_down() -> None:
    """Stop every Spark process this cluster folder started, also after a crash."""
    from changeover.cli import sql_agent
    from changeover.cluster import membership_for

    settings = _plain_settings()
    sql_agent.stop_all(settings)  # its sessions were on this cluster's Connect servers
    stopped = membership_for(settings).down()
    _out().print(f"stopped: {', '.join(stopped) or 'nothing was running'}")


@cluster_app.command("status")
def cluster_status(as_json: JsonFlag = False) -> None:
    """Members: name, version, status, group; and the masters."""
    from changeover.cluster import membership_for

    status = membership_for(_settings()).status()
    if as_json:
        print(json.dumps(status, indent=2))
        return
    _emit(status["members"], False, [("NAME", "name"), ("VERSION", "version"), ("STATUS", "status"),
                                     ("GROUP", "group"), ("HOST", "host"), ("RUNNING", "running"),
                                     ("CONNECT", "connect")])
    _emit(status["masters"], False, [("GROUP", "version"), ("MASTER", "url"), ("WEB UI", "webui"),
                                     ("RUNNING", "running")])


@runtime_app.command("install")
def runtime_install(version: str) -> None:
    """Install the Spark runtime of a version (idempotent)."""
    from changeover.cluster.runtimes import install_runtime

    runtime = install_runtime(_plain_settings().runtimes_dir, version)
    _out().print(f"Spark {version} runtime at {runtime.root}")


@runtime_app.command("list")
def runtime_list(as_json: JsonFlag = False) -> None:
    """The supported Spark versions, and which are installed."""
    from changeover.cluster.runtimes import SUPPORTED_VERSIONS, installed_versions

    installed = installed_versions(_plain_settings().runtimes_dir)
    rows = [{"version": v, "installed": v in installed} for v in SUPPORTED_VERSIONS]
    _emit(rows, as_json, [("VERSION", "version"), ("INSTALLED", "installed")])


@app.command("jobs")
def list_jobs(as_json: JsonFlag = False) -> None:
    """Jobs with their current run: state, version and member."""
    from changeover import jobs
    from changeover.cluster import membership_for

    settings = _settings()
    jobs.refresh_all(settings, membership_for(settings))
    _emit(jobs.list_jobs(settings), as_json, [("NAME", "name"), ("STATE", "state"), ("VERSION", "version"),
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

    settings = _settings()
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
    _out().print(f"job {name}: run {run.id} submitted to Spark {run.spark_version} as {run.submission_id}")


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

    report = check_code(_settings(), code, savepoint, target_version, _pairs(rename_stage, "--rename-stage"),
                        dry_run=dry_run, strict=strict, dry_run_timeout=dry_run_timeout,
                        state_partitions=state_partitions)
    if as_json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        _out().print(report.render(), soft_wrap=True)
    raise typer.Exit(int(report.verdict))


@app.command("savepoint")
def savepoint(
    words: Annotated[list[str], typer.Argument(metavar="JOB NAME | delete JOB NAME")],
    cancel: Annotated[bool, typer.Option("--cancel", "-C", help="Stop the job at a batch boundary first.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the stop.")] = 120,
) -> None:
    """Take a savepoint of a job (as Jet's save-snapshot does), or delete one.

    Without --cancel the job keeps running (Flink's `savepoint`); with it, the job stops at a batch
    boundary first (Flink's `stop --savepointPath`).
    """
    from changeover import jobs, savepoints
    from changeover.cluster import membership_for
    from changeover.names import check_name

    if len(words) == 3 and words[0] == "delete":
        savepoints.delete(_settings(), words[1], words[2])
        _out().print(f"savepoint {words[2]} of job {words[1]} deleted")
        return
    if len(words) != 2:
        raise ChangeoverError(f"savepoint {' '.join(words)!r}", "it takes JOB NAME, or delete JOB NAME",
                              "see `changeover savepoint --help`")
    job, name = words
    check_name("savepoint", name)
    settings = _settings()
    savepoints.check_available(settings, job, name)
    if cancel:
        cluster = membership_for(settings)
        savepoints.request_stop(settings, job, reason=f"savepoint {name}")
        deadline = time.monotonic() + timeout
        while (run := jobs.refresh(settings, cluster, job)) is not None and run.state in jobs.LIVE:
            if time.monotonic() > deadline:
                raise ChangeoverError(f"savepoint {name!r} of job {job}",
                                      f"the job did not stop within {timeout:.0f} s", "retry with a larger --timeout")
            time.sleep(0.5)
    sp = savepoints.take(settings, job, name, mode="stop" if cancel else "continue")
    _out().print(f"savepoint {sp.name} of job {job} ({sp.mode}): {sp.size_bytes:,} bytes at batches {sp.stages}")


@app.command("savepoints")
def list_savepoints(job: Annotated[str | None, typer.Option(help="Only this job's savepoints.")] = None,
                    as_json: JsonFlag = False) -> None:
    """TIME, SIZE (bytes), JOB NAME, SAVEPOINT NAME (the columns of Jet's list-snapshots), then Spark version
    and mode."""
    from changeover import savepoints

    _emit(savepoints.list_savepoints(_settings(), job), as_json,
          [("TIME", "time"), ("SIZE (bytes)", "size_bytes"), ("JOB NAME", "job"), ("SAVEPOINT NAME", "name"),
           ("SPARK", "spark_version"), ("MODE", "mode")])


@app.command("retention")
def retention(
    job: str,
    max_count: Annotated[int | None, typer.Option(min=1, help="Keep at most this many savepoints.")] = None,
    max_age_hours: Annotated[float | None, typer.Option(min=0, help="Delete savepoints older than this.")] = None,
) -> None:
    """Apply a retention policy; the newest savepoint and those an unfinished upgrade uses are kept."""
    from changeover import savepoints

    age = timedelta(hours=max_age_hours) if max_age_hours is not None else None
    deleted = savepoints.apply_retention(_settings(), job, max_count, age)
    _out().print(f"deleted: {', '.join(deleted) or 'nothing'}")


@app.command("sql")
def sql(
    statement: str,
    block_shutdown: Annotated[bool, typer.Option("--block-shutdown/--no-block-shutdown", show_default=False,
                                                 help="Hold a drain of its member until it ends (the default, as "
                                                      "for SQL), or be interrupted after --shutdown-timeout.")] = True,
    shutdown_timeout: Annotated[int, typer.Option(help="Seconds a drain waits before it interrupts it.")] = 30,
    tries: Annotated[int, typer.Option(help="Members to try when a version check refuses it.")] = 3,
    agent: Annotated[bool, typer.Option(
        "--agent/--no-agent", help="Hand it to the SQL agent, which keeps sessions open between commands (started "
                                   "if none runs; it stops after 10 idle minutes), or run it in this process: "
                                   "about 5 s more.")] = True,
    as_json: JsonFlag = False,
) -> None:
    """Run SQL as a light job on the largest version group, through a member's Spark Connect server."""
    from changeover.cli import sql_agent

    settings = _plain_settings()
    options = {"block_shutdown": block_shutdown, "shutdown_timeout": shutdown_timeout, "tries": tries}
    answer = sql_agent.run_sql(settings, statement, **options) if agent else None
    if answer is None:
        answer = _sql_here(statement, **options)
    rows, member, version = answer["rows"], answer["member"], answer["version"]
    if as_json:
        print(json.dumps({"member": member, "version": version, "rows": rows}, indent=2, default=str))
        return
    columns = [(name.upper(), name) for name in (rows[0] if rows else {})]
    if columns:
        _emit(rows, False, columns)
    _out().print(f"{len(rows)} rows, on member {member} (Spark {version})")


def _sql_here(statement: str, **options: Any) -> dict[str, Any]:
    """The statement run in this process, with a session of its own (what the agent does with a pooled one)."""
    import warnings

    from changeover.cli import sql_agent

    warnings.filterwarnings("ignore", message="PySpark does not yet fully support pandas", category=FutureWarning)
    from pyspark.errors import PySparkException

    from changeover import light  # the Connect client loads pandas, pyarrow and gRPC: about 3 s

    try:
        rows, where = light.run_sql(_settings(), statement, **options)
    except PySparkException as exc:
        raise sql_agent.spark_refusal(statement, exc) from None
    return {"rows": rows, "member": where.member, "version": where.version}


@light_app.command("list")
def light_list(
    show_all: Annotated[bool, typer.Option("--all", help="Every state, not only the running ones.")] = False,
    limit: Annotated[int, typer.Option(help="At most this many, newest first.")] = 50,
    as_json: JsonFlag = False,
) -> None:
    """Light jobs the registry holds: where each runs, for whom, and whether it holds a drain."""
    from changeover.light import ledger

    rows = [{"tag": j.tag, "state": j.state, "member": j.member, "version": j.spark_version, "user": j.user_id,
             "blocks_drain": j.block_shutdown, "started": j.started_at, "statement": j.statement or ""}
            for j in ledger.recent(_settings(), running_only=not show_all, limit=limit)]
    if as_json or rows:
        _emit(rows, as_json, [("TAG", "tag"), ("STATE", "state"), ("MEMBER", "member"), ("VERSION", "version"),
                              ("USER", "user"), ("BLOCKS DRAIN", "blocks_drain"), ("STATEMENT", "statement")])
    if not as_json:
        _out().print(f"{len(rows)} light jobs{'' if show_all else ' running'}")


@light_app.command("interrupt")
def light_interrupt(tag: str, reason: Annotated[str, typer.Option(help="Recorded with the job.")] = "asked from the CLI"
                    ) -> None:
    """Interrupt a running light job's operations on its server, by its tag."""
    from changeover import light
    from changeover.light import ledger

    settings = _settings()
    job = ledger.get(settings, tag)
    if job.state != "RUNNING":
        raise ChangeoverError(f"light job {tag}", f"it is {job.state}, not running", "list running ones with "
                              "`changeover light list`")
    done = light.interrupt(settings, tag, reason)
    _out().print(f"light job {tag} interrupted ({len(done)} operations) on member {job.member}")


@app.command("leaks")
def leaks_check(
    grace: Annotated[float, typer.Option(help="Seconds a leak must be seen before it is cleaned.")] = 600,
    as_json: JsonFlag = False,
) -> None:
    """Find what the registry and Spark disagree on (runs, drivers, light jobs, PID files, staging folders) and
    clean what has been seen for longer than the grace, as the leak_checker DAG does."""
    from changeover.cluster import membership_for
    from changeover.housekeeping import leaks

    settings = _settings()
    report = leaks.check(settings, membership_for(settings), grace).as_dict()
    if as_json:
        print(json.dumps(report, indent=2, default=str))
        return
    found = report["found"]
    if found:
        _emit(found, False, [("KIND", "kind"), ("SUBJECT", "subject"), ("STATE", "state"),
                             ("SEEN FOR (S)", "seen_for"), ("WHY", "why")])
    _out().print(f"{len(found)} found, {len(report['cleaned'])} cleaned")
    for refusal in report["refused"]:
        _out().print(f"refused: {refusal}")


@app.command("reconcile")
def reconcile() -> None:
    """Remove what crashed savepoints left behind: PENDING rows and staging folders."""
    from changeover import savepoints

    removed = savepoints.reconcile(_settings())
    rows, folders = ", ".join(removed["rows"]) or "none", ", ".join(removed["folders"]) or "none"
    _out().print(f"removed rows: {rows}; folders: {folders}")


@app.command("drain")
def drain_member(member: str, timeout: Annotated[float, typer.Option(help="Seconds before giving up.")] = 600,
                 abort: Annotated[bool, typer.Option("--abort", help="Give the member back to service instead.")]
                 = False) -> None:
    """Drain a member: savepoint and move fault-tolerant jobs, wait for blocking ones, cancel the rest."""
    from changeover.cluster import membership_for
    from changeover.upgrade import drain

    settings = _settings()
    cluster = membership_for(settings)
    if abort:
        given = drain.abort(settings, cluster, member, "aborted by hand")
        _out().print(f"member {member} {'back in service' if given else 'was not being drained: left as it is'}")
        return
    deadline = time.monotonic() + timeout
    while not (result := drain.step(settings, cluster, member)).done:
        if result.blocked_by:
            raise ChangeoverError(f"drain of member {member}", f"member {', '.join(result.blocked_by)} is being "
                                  "drained or upgraded, and members are drained one at a time",
                                  "wait until `changeover cluster status` shows it ACTIVE, then drain again")
        if time.monotonic() > deadline:
            raise ChangeoverError(f"drain of member {member}", f"it did not finish within {timeout:.0f} s",
                                  f"see what it waits for: {result.as_dict()}")
        time.sleep(1)
    _out().print(f"member {member} drained")


@upgrade_app.command("member")
def upgrade_member(member: str, to: Annotated[str, typer.Option("--to", help="Target Spark version.")]) -> None:
    """Restart a drained member on another Spark version."""
    from changeover.cluster import membership_for
    from changeover.upgrade import member_upgrade

    settings = _settings()
    old = member_upgrade.upgrade_member(settings, membership_for(settings), member, to)
    _out().print(f"member {member}: {old} -> {to}")


UpgradeKey = Annotated[str, typer.Argument(help="The upgrade's key, DAG/RUN_ID, as `changeover upgrades` lists it.")]


@upgrade_app.command("status")
def upgrade_status(key: UpgradeKey, as_json: JsonFlag = False, follow: Annotated[bool, typer.Option(
        "--follow", help="Show the roll live until it ends: a bar of members done, each member's phase, each job's "
                         "moves and their downtime.")] = False) -> None:
    """Where an upgrade is: each member's phase and actual state, jobs asked to move, savepoints it holds."""
    if follow:
        from changeover.cli import progress

        progress.follow(_settings(), key)
        return
    from changeover.upgrade import recovery

    found = recovery.status(_settings(), key)
    if as_json:
        _out().print_json(json.dumps(found))
        return
    _out().print(f"upgrade {found['key']} to {found['target_version']}: {found['status']}"
              f"{' (holds the upgrade lock)' if found['locked'] else ''}, by {found['actor'] or 'unknown'}")
    _emit(found["members"], False, [("MEMBER", "name"), ("PHASE", "phase"), ("STATUS", "status"),
                                    ("VERSION", "version"), ("REASON", "reason")])
    _out().print(f"jobs asked to move: {', '.join(found['jobs_asked_to_move']) or 'none'}")
    _out().print(f"savepoints held: {', '.join(found['savepoints']) or 'none'}")


@upgrade_app.command("abort")
def upgrade_abort(key: UpgradeKey, reason: Annotated[str, typer.Option(help="Why, for the audit.")] = "aborted by hand"
                  ) -> None:
    """Undo what a failed or abandoned upgrade left: members back in service, jobs running, savepoints released."""
    from changeover.cluster import membership_for
    from changeover.upgrade import recovery

    settings = _settings()
    found = recovery.abort(settings, membership_for(settings), key, reason)
    _out().print(f"upgrade {key} aborted: " + ", ".join(f"{m['name']} {m['status']} at {m['version']}"
                                                     for m in found["members"]))


@upgrade_app.command("resume")
def upgrade_resume(key: UpgradeKey) -> None:
    """Take the lock again for a FAILED upgrade; then clear its Airflow run's failed tasks to go on from there."""
    from changeover.upgrade import recovery

    recovery.resume(_settings(), key)
    _out().print(f"upgrade {key} holds the lock again: clear its failed tasks in Airflow to continue")


@app.command("events")
def events(
    limit: Annotated[int, typer.Option(help="At most this many, the newest.")] = 50,
    job: Annotated[str | None, typer.Option(help="Only actions on this job.")] = None,
    member: Annotated[str | None, typer.Option(help="Only actions on this member.")] = None,
    upgrade_key: Annotated[str | None, typer.Option("--upgrade", help="Only actions of this upgrade (run id).")] = None,
    since: Annotated[datetime | None, typer.Option(help="From this UTC time on (ISO 8601).")] = None,
    until: Annotated[datetime | None, typer.Option(help="Up to this UTC time (ISO 8601).")] = None,
    as_json: JsonFlag = False,
) -> None:
    """The audit trail, newest last: who did what to which job, member, savepoint or upgrade, and the outcome."""
    from changeover import audit
    from changeover.timeutil import as_utc

    found = audit.find(_settings().database_url, job=job, member=member, upgrade=upgrade_key,
                       since=_utc(since), until=_utc(until), limit=limit)
    rows = [{"at": as_utc(e.at).isoformat(timespec="seconds"), "actor": e.actor, "action": e.action,
             "subject": f"{e.subject_kind}:{e.subject}", "outcome": e.outcome, "upgrade": e.upgrade,
             "details": e.details} for e in found]
    if as_json:
        print(json.dumps(rows, indent=2, default=str))
        return
    # A block per event, not a table: an actor and its details are too long for columns in 80 characters.
    for row in rows:
        _out().print(f"{row['at']}  {row['action']}  {row['outcome']}  {row['subject']}", overflow="fold")
        _out().print(f"  by {row['actor']}", overflow="fold")
        details = "  ".join(f"{key}={json.dumps(value, default=str)}" for key, value in row["details"].items())
        if details:
            _out().print(f"  {details}", overflow="fold")


@upgrades_app.callback()
def upgrades_list(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """Every upgrade: its key (the Airflow run id), target, status, who started it and each member's phase."""
    if ctx.invoked_subcommand is not None:
        return
    from changeover.upgrade import lock

    _emit(lock.list_upgrades(_settings()), as_json,
          [("KEY", "key"), ("TARGET", "target_version"), ("STATUS", "status"), ("ACTOR", "actor"),
           ("STARTED", "started_at"), ("MEMBERS", "phases")])


@maintenance_app.callback()
def maintenance_list(ctx: typer.Context) -> None:
    """The members the drain_window DAG drains and upgrades next, in order."""
    if ctx.invoked_subcommand is None:
        from changeover.upgrade import maintenance

        _out().print(", ".join(maintenance.marked(_settings())) or "no member is marked")


@maintenance_app.command("mark")
def maintenance_mark(member: str, reason: Annotated[str, typer.Option(help="Why, for the audit.")] = "upgrade") -> None:
    """Mark a member for the next drain window."""
    from changeover.upgrade import maintenance

    maintenance.mark(_settings(), member, reason)


@maintenance_app.command("unmark")
def maintenance_unmark(member: str) -> None:
    """Take a member off the next drain window."""
    from changeover.upgrade import maintenance

    maintenance.unmark(_settings(), member, "unmarked by hand")


@upgrades_app.command("release")
def upgrades_release(key: str) -> None:
    """End an upgrade whose Airflow run is gone as FAILED, so that a new one can start."""
    from changeover.upgrade import lock

    if lock.release(_settings(), key, "FAILED", "released by hand"):
        _out().print(f"upgrade {key} released")
    else:
        _out().print(f"upgrade {key} had ended already; nothing changed")


def _utc(moment: datetime | None) -> datetime | None:
    return None if moment is None else (moment if moment.tzinfo else moment.replace(tzinfo=UTC))


@app.command("demo")
def demo(
    keep_airflow: Annotated[bool, typer.Option("--keep-airflow", help="Leave Airflow running afterwards.")] = False,
) -> None:
    """Roll a live stateful job through a rolling Spark upgrade, triggered in a real Airflow as the UI does."""
    from changeover.cli.demo import run_demo

    raise typer.Exit(run_demo(keep_airflow))


def main() -> None:
    # At exit, what the command loaded (Spark Connect's client, pandas, SQLAlchemy) is left to the process's end
    # rather than collected by the interpreter's teardown: `changeover sql --no-agent` ends 0.6 s sooner.
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
    try:
        app()
    except ChangeoverError as exc:
        from rich.console import Console
        from rich.text import Text

        Console(stderr=True, highlight=False).print(Text.assemble(("error: ", "bold red"), str(exc)), soft_wrap=True)
        sys.exit(2)
