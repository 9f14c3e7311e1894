"""Submitting, observing, stopping and resuming jobs on a version group."""

from __future__ import annotations

import importlib.util
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import select

from changeover import audit, lease, routing
from changeover.cluster import Membership, wait_for
from changeover.errors import ChangeoverError
from changeover.names import check_name
from changeover.registry.db import lock_row, session_scope
from changeover.registry.models import Job, JobRun, Member, utcnow
from changeover.runtimes import find_runtime
from changeover.settings import CHECKOUT, Settings

INCLUDE = CHECKOUT / "include"
DRIVER = INCLUDE / "changeover_driver.py"
LIVE = ("SUBMITTED", "RUNNING")
DRIVER_STATES = {"RUNNING": "RUNNING", "FINISHED": "FINISHED", "FAILED": "FAILED", "ERROR": "FAILED",
                 "KILLED": "KILLED"}


def get_job(s: Any, name: str) -> Job:
    job = s.get(Job, name)
    if job is None:
        known = ", ".join(s.scalars(select(Job.name).order_by(Job.name))) or "none"
        raise ChangeoverError(f"job {name!r}", f"no such job (known: {known})", "use a name from `changeover jobs`")
    return job


def current_run(s: Any, job: Job) -> JobRun | None:
    return s.get(JobRun, job.current_run_id) if job.current_run_id else None


def submit(
    settings: Settings,
    membership: Membership,
    module: str,
    name: str,
    *,
    fault_tolerant: bool = True,
    block_shutdown: bool = False,
    shutdown_timeout: int = 30,
    options: dict[str, Any] | None = None,
    from_savepoint: str | None = None,
    rename_stages: dict[str, str] | None = None,
    allow_non_restored_state: bool = False,
    rewind_sink: bool = False,
) -> JobRun:
    """Create the job and launch it on the largest version group. A live job of that name is returned as is.

    from_savepoint is NAME (a savepoint of this job) or JOB/NAME (of another job, e.g. a second copy).
    """
    check_name("job", name)
    if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
        raise ChangeoverError(f"job module {module!r}", "it cannot be imported from include/",
                              "put the module under include/jobs/ and pass it as jobs.NAME")
    with session_scope(settings.database_url) as s:
        job = s.get(Job, name)
        if job is not None:
            run = current_run(s, job)
            if run is not None and run.state in LIVE:
                return run
        else:
            job = Job(name=name, module=module, fault_tolerant=fault_tolerant, block_shutdown=block_shutdown,
                      shutdown_timeout=shutdown_timeout, options=options or {})
            s.add(job)
            audit.record(s, "job.create", "job", name, module=module, fault_tolerant=fault_tolerant,
                         block_shutdown=block_shutdown, shutdown_timeout=shutdown_timeout)
    version = routing.target_version(settings)
    if from_savepoint:
        from changeover.savepoints import restore  # local import: savepoints imports this module

        source_job, _, savepoint = from_savepoint.rpartition("/")
        root = restore(settings, name, savepoint, source_job=source_job or name, rename=rename_stages,
                       rewind_sink=rewind_sink)
        return launch(settings, membership, name, version, root, from_savepoint, allow_non_restored_state)
    return launch(settings, membership, name, version, new_checkpoint_root(settings, name))


def resume(
    settings: Settings,
    membership: Membership,
    job_name: str,
    from_savepoint: str,
    *,
    rename_stages: dict[str, str] | None = None,
    allow_non_restored_state: bool = False,
    rewind_sink: bool = False,
) -> JobRun:
    """Resume an existing job from a savepoint; a live job is returned as it is."""
    with session_scope(settings.database_url) as s:
        module = get_job(s, job_name).module
    return submit(settings, membership, module, job_name, from_savepoint=from_savepoint,
                  rename_stages=rename_stages, allow_non_restored_state=allow_non_restored_state,
                  rewind_sink=rewind_sink)


def fault_tolerant_jobs(settings: Settings) -> list[str]:
    with session_scope(settings.database_url) as s:
        return list(s.scalars(select(Job.name).where(Job.fault_tolerant.is_(True)).order_by(Job.name)))


def new_checkpoint_root(settings: Settings, job: str) -> Path:
    base = settings.checkpoint_dir / job
    generation = len(list(base.glob("gen-*"))) if base.exists() else 0
    return base / f"gen-{generation}"


def launch(
    settings: Settings,
    membership: Membership,
    job_name: str,
    version: str,
    checkpoint_root: Path,
    from_savepoint: str | None = None,
    allow_non_restored_state: bool = False,
    replaces_run: int | None = None,
    replaces_park: int | None = None,
) -> JobRun:
    """Place a Python driver on a worker of the version group through the master's REST server.

    replaces_run: the parked run this launch succeeds. The launch is refused if that run has meanwhile
    reclaimed the job (its lease ran out), or stopped again since (replaces_park, its park count then), so
    that a late orchestrator never fences a live run nor starts from a stale savepoint. The replaced run's
    lease then counts from this launch: the successor's start is not charged to it.
    """
    runtime = find_runtime(settings.runtimes_dir, version)
    master = membership.master(version)
    served = master.server_version()
    if served != version:  # the router's re-check, just before launch
        raise ChangeoverError(f"launch of job {job_name} on the {version} group",
                              f"its master now serves Spark {served}", "retry: routing will pick the group again")
    with session_scope(settings.database_url) as s:
        job = get_job(s, job_name)
        if replaces_run is not None:
            job = lock_row(s, Job, job_name)
            before = current_run(s, job)
            if (job.current_run_id != replaces_run or before is None or before.state != "STOPPED"
                    or (replaces_park is not None and before.parks != replaces_park)):
                raise ChangeoverError(f"launch of a successor to run {replaces_run} of job {job_name}",
                                      "that run is no longer stopped where its savepoint was taken: it resumed "
                                      "meanwhile, or stopped again", "retry the task: it looks at the job again")
            if before.parked:
                before.lease_until = utcnow() + timedelta(seconds=float(job.options.get("lease_seconds")
                                                                        or lease.lease_seconds()))
        run = JobRun(job=job_name, spark_version=version, master_url=master_url(master), state="SUBMITTED",
                     checkpoint_root=str(checkpoint_root), from_savepoint=from_savepoint, progress={})
        s.add(run)
        s.flush()
        job.current_run_id, job.desired = run.id, "RUN"
        module, run_id = job.module, run.id
        trigger = float(job.options.get("trigger_seconds", 1.0))
        lease_seconds = float(job.options.get("lease_seconds") or lease.lease_seconds())
    checkpoint_root.mkdir(parents=True, exist_ok=True)
    env = {"PYSPARK_PYTHON": str(runtime.python), "PYTHONPATH": str(INCLUDE), "CHANGEOVER_ACTOR": f"driver:{job_name}",
           **settings.as_env()}
    confs = {
        "spark.pyspark.python": str(runtime.python),
        "spark.executorEnv.PYTHONPATH": str(INCLUDE),
        "spark.cores.max": "1",
        "spark.executor.cores": "1",
        "spark.executor.memory": "1g",
        "spark.sql.shuffle.partitions": "4",
        "spark.decommission.enabled": "true",
        "spark.ui.enabled": "false",
        "spark.sql.session.timeZone": "UTC",
    }
    app_args = ["--master", master_url(master)]
    for key, value in confs.items():
        app_args += ["--conf", f"{key}={value}"]
    app_args += [str(DRIVER), "--job", job_name, "--run-id", str(run_id), "--module", module,
                 "--expected-version", version, "--checkpoint-root", str(checkpoint_root),
                 "--trigger-seconds", str(trigger), "--lease-seconds", str(lease_seconds)]
    if allow_non_restored_state:
        app_args.append("--allow-non-restored-state")
    request = {
        "action": "CreateSubmissionRequest",
        "appResource": f"file:{DRIVER}",
        "mainClass": "org.apache.spark.deploy.SparkSubmit",
        "appArgs": app_args,
        "clientSparkVersion": version,
        "environmentVariables": env,
        "sparkProperties": {
            "spark.app.name": f"changeover-{job_name}",
            "spark.master": master_url(master),
            "spark.submit.deployMode": "cluster",
            "spark.driver.supervise": "false",
            "spark.driver.memory": "1g",
            "spark.driver.cores": "1",
        },
    }
    submission_id = master.create(request)
    with session_scope(settings.database_url) as s:
        run = s.get(JobRun, run_id)
        assert run is not None
        run.submission_id = submission_id
        audit.record(s, "job.launch", "job", job_name, run=run_id, version=version, submission=submission_id,
                     from_savepoint=from_savepoint)
        return run


def master_url(master: Any) -> str:
    state = master.state()
    return str(state["url"])


def refresh(settings: Settings, membership: Membership, job_name: str) -> JobRun | None:
    """Observe the current run's driver through its master and record its state and member."""
    with session_scope(settings.database_url) as s:
        run = current_run(s, get_job(s, job_name))
        if run is None:
            return None
        run_id = run.id
    return observe(settings, membership, run_id)


def observe(settings: Settings, membership: Membership, run_id: int) -> JobRun:
    """Ask the run's master about its driver. A live or parked run whose driver has ended is recorded so."""
    with session_scope(settings.database_url) as s:
        run = s.get(JobRun, run_id)
        assert run is not None
        if run.submission_id is None or not (run.state in LIVE or run.parked):
            return run
        version, submission = run.spark_version, run.submission_id
    try:
        status = membership.master(version).status(submission)
    except ChangeoverError:
        status = None  # the group's master is gone, and the driver with it
    with session_scope(settings.database_url) as s:
        run = s.get(JobRun, run_id)
        assert run is not None
        if status is not None and status.worker_host:
            run.member = s.scalar(select(Member.name).where(Member.host == status.worker_host))
        if status is None and run.parked:
            return run  # no answer is no news: a parked driver ends itself, so only its master's word ends it here
        observed = DRIVER_STATES.get(status.state) if status else "KILLED"
        if observed and observed != "RUNNING" and run.parked:
            run.ended_at = utcnow()  # its driver is gone; the checkpoint still ends on a batch boundary
            audit.record(s, "job.end", "job", run.job, run=run.id, state="STOPPED", driver=observed)
        elif observed and observed != "RUNNING" and run.state in LIVE:
            run.state, run.ended_at = observed, run.ended_at or utcnow()
            audit.record(s, "job.end", "job", run.job, run=run.id, state=observed)
        elif observed == "RUNNING" and run.state == "SUBMITTED" and run.heartbeat_at is not None:
            run.state = "RUNNING"
        return run


def parked_runs_on(settings: Settings, membership: Membership, member: str) -> list[JobRun]:
    """Runs parked on a member whose drivers still live: they exit once their successors write."""
    with session_scope(settings.database_url) as s:
        ids = list(s.scalars(select(JobRun.id).where(
            JobRun.member == member, JobRun.state == "STOPPED", JobRun.ended_at.is_(None))))
    return [run for run in (observe(settings, membership, i) for i in ids) if run.parked]


def refresh_all(
    settings: Settings, membership: Membership, fault_tolerant_only: bool = False
) -> list[tuple[Job, JobRun | None]]:
    """Every job (or every fault-tolerant one) with its freshly observed current run."""
    with session_scope(settings.database_url) as s:
        query = select(Job).order_by(Job.name)
        if fault_tolerant_only:
            query = query.where(Job.fault_tolerant.is_(True))
        listed = list(s.scalars(query))
    return [(job, refresh(settings, membership, job.name)) for job in listed]


def wait_until_committed(settings: Settings, membership: Membership, job_name: str, timeout: float = 240) -> JobRun:
    """Wait for the current run's first committed batch; a run that ends first is an error at once."""

    def committed() -> bool:
        run = refresh(settings, membership, job_name)
        if run is None or run.state in ("FAILED", "KILLED", "FINISHED"):
            raise RuntimeError(f"job {job_name} ended before its first commit: {run and run.error}")
        return run.first_commit_at is not None

    wait_for(committed, timeout, f"job {job_name} committing its first batch")
    run = refresh(settings, membership, job_name)
    assert run is not None
    return run


def cancel(settings: Settings, membership: Membership, job_name: str, reason: str) -> None:
    with session_scope(settings.database_url) as s:
        run = current_run(s, get_job(s, job_name))
        if run is None or run.state not in LIVE or run.submission_id is None:
            return
        version, submission = run.spark_version, run.submission_id
    membership.master(version).kill(submission)
    with session_scope(settings.database_url) as s:
        run = current_run(s, get_job(s, job_name))
        assert run is not None
        run.state, run.ended_at = "KILLED", utcnow()
        audit.record(s, "job.cancel", "job", job_name, run=run.id, reason=reason)


def list_jobs(settings: Settings) -> list[dict[str, Any]]:
    with session_scope(settings.database_url) as s:
        rows = []
        for job in s.scalars(select(Job).order_by(Job.name)):
            run = current_run(s, job)
            rows.append({
                "name": job.name, "module": job.module, "fault_tolerant": job.fault_tolerant,
                "block_shutdown": job.block_shutdown, "shutdown_timeout": job.shutdown_timeout,
                "state": run.state if run else "NEW", "version": run.spark_version if run else None,
                "member": run.member if run else None, "run": run.id if run else None,
                "progress": run.progress if run else {},
            })
        return rows
