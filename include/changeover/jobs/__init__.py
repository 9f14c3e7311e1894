"""Submitting, observing, stopping and resuming jobs on a version group."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import select, update

from changeover import audit, faults
from changeover.cluster import Membership, NoMaster, wait_for
from changeover.cluster.spark_master import DriverStatus, MasterUnreachable
from changeover.compat import rescale_check
from changeover.compat.version_table import require_resumable
from changeover.errors import ChangeoverError
from changeover.handoff import lease
from changeover.jobs.intents import START, ContinueRun, Intent, Standby
from changeover.jobs.shipping import runtime_artifacts, store_job_code
from changeover.jobs.spark_settings import SparkSettings, state_store_confs
from changeover.names import check_name
from changeover.registry.db import lock_row, session_scope
from changeover.registry.models import Job, JobRun, Member, utcnow
from changeover.registry.records import LIVE, STANDBY, current_run, get_job, own_job
from changeover.registry.states import PARKED_FORMS, Desired, RunState
from changeover.runtime import checkpoints
from changeover.savepoints import get_savepoint, restore
from changeover.settings import Settings
from changeover.timeutil import as_utc
from changeover.upgrade import routing

log = logging.getLogger(__name__)
# ERROR is Spark's word for a driver whose worker was lost (or that could not be started): not the job's own
# failure, so a fault-tolerant job goes on from its checkpoint, as after a kill.
DRIVER_STATES = {"RUNNING": "RUNNING", "FINISHED": "FINISHED", "FAILED": "FAILED", "ERROR": "KILLED",
                 "KILLED": "KILLED"}


def submit(
    settings: Settings,
    membership: Membership,
    code: str,
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
    accept_duplicates: bool = False,
    state_partitions: int | None = None,
) -> JobRun:
    """Create the job and launch it on the largest version group. A live job of that name is returned as is.

    code is the path of the job's .py file or package folder, anywhere, or an importable module (jobs.clicks);
    it is frozen as an artifact at the job's creation. A job whose last run ended (stopped, failed or killed)
    continues from that run's checkpoint, so its batch ids go on from where its sinks are.
    from_savepoint is NAME (a savepoint of this job) or JOB/NAME (of another job, e.g. a second copy).
    state_partitions: with from_savepoint, the restored stages' state is repartitioned to that many partitions by
    the new run's driver, on its own copy, before they start; checked first (`compat.rescale_check`).
    """
    check_name("job", name)
    state_store_confs(options or {})  # an unknown store is refused before anything is created
    if state_partitions is not None and not from_savepoint:
        raise ChangeoverError(f"submit of job {name} with {state_partitions} state partitions",
                              "a new count applies to state restored from a savepoint",
                              "stop the job with a savepoint, then resume it with --from-savepoint and the count")
    with session_scope(settings.database_url) as s:
        job = s.get(Job, name)
        previous = current_run(s, job) if job is not None else None
        if previous is not None and (previous.state in LIVE or previous.parked):
            return previous
        if job is None:
            shipped = store_job_code(settings, name, code)
            job = Job(name=name, module=shipped.module, code=str(shipped.artifact), entry=shipped.entry,
                      fault_tolerant=fault_tolerant, block_shutdown=block_shutdown,
                      shutdown_timeout=shutdown_timeout, options=options or {})
            s.add(job)
            audit.record(s, "job.create", "job", name, code=str(shipped.artifact), entry=shipped.entry,
                         fault_tolerant=fault_tolerant, block_shutdown=block_shutdown,
                         shutdown_timeout=shutdown_timeout)
        if job.code and code != job.code and store_job_code(settings, name, code).artifact != Path(job.code):
            raise ChangeoverError(f"submit of job {name} with {code}", "the job exists with other code, and a "
                                  "submit never changes a job's code behind its savepoints",
                                  "submit the new code under a new name, or resume this job from a savepoint")
        continues = previous if previous is not None and job.entry == "build" else None
    version = routing.target_version(settings)
    if from_savepoint:
        source_job, _, savepoint = from_savepoint.rpartition("/")
        with session_scope(settings.database_url) as s:
            saved = get_savepoint(s, source_job or name, savepoint)
            written_by, saved_at = saved.spark_version, Path(saved.path)
        require_resumable(written_by, version, f"resume of job {name} from savepoint {from_savepoint} on Spark "
                                               f"{version}")
        moving = [] if state_partitions is None else [
            (rename_stages or {}).get(stage, stage)
            for stage in rescale_check.require(name, from_savepoint, saved_at, version, state_partitions)]
        root = restore(settings, name, savepoint, source_job=source_job or name, rename=rename_stages,
                       rewind_sink=rewind_sink, accept_duplicates=accept_duplicates, rescaled=moving)
        return launch(settings, membership, name, version, root, from_savepoint=from_savepoint,
                      allow_non_restored_state=allow_non_restored_state, state_partitions=state_partitions)
    root = checkpoints.new_checkpoint_root(settings, name)
    if continues is None or not continues.checkpoint_root or not Path(continues.checkpoint_root).is_dir():
        continues = None
    return launch(settings, membership, name, version, root, copy_from=continues)


def _require_gone(membership: Membership, previous: JobRun) -> None:
    """Its master does not run its driver any more: two drivers must not share a checkpoint."""
    if previous.submission_id is not None:
        try:
            status = membership.master(previous.spark_version).status(previous.submission_id)
        except NoMaster:
            status = None  # its group's master is gone, and its drivers with it
        if status is not None and status.state in ("SUBMITTED", "RUNNING", "RELAUNCHING"):
            raise ChangeoverError(f"resubmit of job {previous.job}", f"the driver of its run {previous.id} is still "
                                  f"{status.state} according to its master, and two drivers must not share a "
                                  "checkpoint", "wait until it has ended (`changeover jobs`), then submit again")


LAYING_OUT = ".laying-out"  # in a checkpoint root being laid out: the root it is copied from


def _copy_checkpoint(settings: Settings, previous: JobRun, root: Path) -> None:
    """Lay out the ended run's checkpoint as of its last commit, with the batch it had planned next, so the
    resubmitted job replays that batch with the same offsets and goes on with the batch ids its sinks expect.
    The root is marked while it is laid out: a copy cut short (its task killed) is never taken for a checkpoint."""
    source = _whole_source(Path(previous.checkpoint_root or ""))
    root.mkdir(parents=True, exist_ok=True)
    (root / LAYING_OUT).write_text(str(source))  # first: while it waits below, the new run is not "never accepted"
    files = 0
    for stage in checkpoints.stage_names(source):
        batch = checkpoints.last_commit(source / stage)
        batch = -1 if batch is None else batch
        files += len(checkpoints.snapshot_stage(source / stage, root / stage, batch).files)
        files += len(checkpoints.snapshot_pending(source / stage, root / stage, batch).files)
    (root / LAYING_OUT).unlink()
    with session_scope(settings.database_url) as s:
        audit.record(s, "job.resubmit", "job", previous.job, run=previous.id, checkpoint=str(source),
                     into=str(root), files=files)


def _whole_source(root: Path) -> Path:
    """The checkpoint to go on from: a root whose layout was cut short stands for the one it was copied from."""
    seen = {root}
    while (marker := root / LAYING_OUT).exists():
        root = Path(marker.read_text())
        if root in seen:
            raise ChangeoverError(f"checkpoint {root}", "its layout markers form a loop",
                                  "resume the job from its newest savepoint")
        seen.add(root)
    return root


def resume(
    settings: Settings,
    membership: Membership,
    job_name: str,
    from_savepoint: str,
    *,
    rename_stages: dict[str, str] | None = None,
    allow_non_restored_state: bool = False,
    rewind_sink: bool = False,
    accept_duplicates: bool = False,
    state_partitions: int | None = None,
) -> JobRun:
    """Resume an existing job from a savepoint; a live job is returned as it is."""
    with session_scope(settings.database_url) as s:
        code = get_job(s, job_name).code or ""
    return submit(settings, membership, code, job_name, from_savepoint=from_savepoint,
                  rename_stages=rename_stages, allow_non_restored_state=allow_non_restored_state,
                  rewind_sink=rewind_sink, accept_duplicates=accept_duplicates, state_partitions=state_partitions)


def options_of(settings: Settings, job_name: str) -> dict[str, Any]:
    """The job's options (refused with the known jobs when there is no such job)."""
    with session_scope(settings.database_url) as s:
        return dict(get_job(s, job_name).options or {})


def fault_tolerant_jobs(settings: Settings) -> list[str]:
    with session_scope(settings.database_url) as s:
        return list(s.scalars(select(Job.name).where(Job.fault_tolerant.is_(True)).order_by(Job.name)))


def launch(
    settings: Settings,
    membership: Membership,
    job_name: str,
    version: str,
    checkpoint_root: Path | None,
    intent: Intent = START,
    *,
    from_savepoint: str | None = None,
    allow_non_restored_state: bool = False,
    copy_from: JobRun | None = None,
    state_partitions: int | None = None,
    code: dict[str, str] | None = None,
) -> JobRun:
    """Place a Python driver on a worker of the version group through the master's REST server, for `intent`
    (`jobs.intents`: what must still hold, under the job row's lock, for the launch to go ahead).

    copy_from: an ended run whose checkpoint this run goes on from, copied into `checkpoint_root` only once this run
    is the job's current one: a run declared dead whose driver still runs is fenced before the copy, so no batch it
    writes can fall between the copy and the hand-over (the successor would plan that batch id again). A run that
    continues one which was to repartition its state keeps that count: a repartition cut short is finished first.
    code: other code than the job's (`Job.code_of`), which becomes the job's once this run owns it.
    """
    if copy_from is not None and state_partitions is None:
        state_partitions = copy_from.state_partitions
    python = membership.driver_python(version)
    if copy_from is not None:
        _require_gone(membership, copy_from)
    master = membership.master(version)
    served = master.server_version()
    if served != version:  # the router's re-check, just before launch
        raise ChangeoverError(f"launch of job {job_name} on the {version} group",
                              f"its master now serves Spark {served}", "retry: routing will pick the group again")
    admitted = _admit(settings, job_name, version, master, checkpoint_root, intent, from_savepoint, copy_from,
                      state_partitions, code)
    if copy_from is not None:
        _lay_out(settings, admitted, copy_from, checkpoint_root or Path())
    try:
        request = _submission(settings, python, master, admitted, version, checkpoint_root,
                              standby=not intent.makes_current, allow_non_restored_state=allow_non_restored_state)
        submission_id = master.create(request)
    except MasterUnreachable:
        raise  # the master may have taken it: the driver names its submission itself, or the loss deadline ends it
    except Exception as exc:  # refused for good, or never sent: no driver will run
        if not intent.makes_current:  # it never owned the job: ended now, not left "warming" until its deadline
            lease.end_standby(settings.database_url, job_name, admitted.run_id, f"its launch failed: {exc}")
        else:
            _hand_back(settings, admitted, copy_from.id if copy_from else None, exc)
        raise
    faults.point(settings, "launch.submitted")  # a lost answer: the driver then records its id itself
    with session_scope(settings.database_url) as s:
        run = s.get(JobRun, admitted.run_id)
        assert run is not None
        run.submission_id = run.submission_id or submission_id
        audit.record(s, "job.launch", "job", job_name, run=run.id, version=version, submission=submission_id,
                     from_savepoint=from_savepoint)
        return run


@dataclass(frozen=True)
class _Admitted:
    """A launch's run, on record, and what its driver is started with."""
    job: str
    run_id: int
    desired_before: str  # the job's desired state before the launch, for a hand-back
    module: str
    entry: str
    code: str | None
    spark_settings: SparkSettings
    stop_deadline: float
    lease_seconds: float
    state_store: dict[str, str]  # the provider conf the job's option state_store asks for
    state_partitions: int | None


def _admit(settings: Settings, job_name: str, version: str, master: Any, checkpoint_root: Path | None,
           intent: Intent, from_savepoint: str | None, copy_from: JobRun | None,
           state_partitions: int | None = None, code: dict[str, str] | None = None) -> _Admitted:
    """Under the job row's lock: the intent's precondition, then the run on record (the job's current one, under a
    new epoch, unless it is a standby), with the launch's first half in the audit."""
    with session_scope(settings.database_url) as s:
        get_job(s, job_name)  # a clear refusal for an unknown job
        job = lock_row(s, Job, job_name)  # every launch: a new owner's epoch is decided under the lock
        intent.admit(s, job)
        if copy_from is not None and job.current_run_id != copy_from.id:
            raise ChangeoverError(f"launch of job {job_name} from the checkpoint of run {copy_from.id}",
                                  f"run {job.current_run_id} is the job's current run now", "leave it as it is: "
                                  "another launch went first; retry the task to look at the job again")
        standby_of = intent.of if isinstance(intent, Standby) else None
        run = JobRun(job=job_name, spark_version=version, master_url=master_url(master),
                     state="SUBMITTED" if standby_of is None else STANDBY, standby_of=standby_of,
                     checkpoint_root=str(checkpoint_root) if checkpoint_root else None,
                     from_savepoint=from_savepoint, progress={}, state_partitions=state_partitions,
                     code=code or job.code_of())
        s.add(run)
        s.flush()
        desired_before = job.desired
        if intent.makes_current:
            before = current_run(s, job)
            if before is not None and before.code is None:  # recorded before runs had code: what it runs, so that
                before.code = job.code_of()  # taking the job back (a failed launch, its lease) brings it back
            own_job(s, job, run, f"launched with other code ({intent.__class__.__name__})")
            job.desired = Desired.RUN
        # The launch's first half, on record with the run: its second (`job.launch`, with the master's
        # submission id) may be lost with the task, and the driver then reconciles it.
        audit.record(s, "job.launch.begin", "job", job_name, run=run.id, version=version,
                     from_savepoint=from_savepoint,
                     **({"state_partitions": state_partitions} if state_partitions is not None else {}))
        launched = run.code or {}
        return _Admitted(job_name, run.id, desired_before, launched["module"], launched["entry"],
                         launched["code"] or None,
                         SparkSettings.from_options(job.options.get("spark") or {}),
                         float(job.options.get("stop_deadline_seconds", 60)), lease.length_of(job),
                         state_store_confs(job.options), state_partitions)


def _lay_out(settings: Settings, admitted: _Admitted, copy_from: JobRun, checkpoint_root: Path) -> None:
    """Copy the ended run's checkpoint for the admitted run, then check, under the lock, that the job is still its."""
    try:
        _copy_checkpoint(settings, copy_from, checkpoint_root)
    except Exception as exc:
        _hand_back(settings, admitted, copy_from.id, exc)
        raise
    with session_scope(settings.database_url) as s:  # still ours after the copy, which may have been slow
        job, mine = lock_row(s, Job, admitted.job), s.get(JobRun, admitted.run_id)
        if (job.current_run_id != admitted.run_id or mine is None or mine.ended_at is not None
                or job.desired == Desired.STOP):
            gone = ChangeoverError(f"launch of job {admitted.job}", "while its checkpoint was laid out, the run was "
                                   "ended, or superseded, or the job stopped", "retry the task to look again")
            s.rollback()
            _hand_back(settings, admitted, copy_from.id, gone)
            raise gone
        mine.submitted_at = utcnow()  # the loss deadline counts from the submission, not from the copy


def _hand_back(settings: Settings, admitted: _Admitted, previous: int | None, exc: Exception) -> None:
    """A launch whose driver will never run (its checkpoint could not be laid out, or its master refused it): this
    run ends FAILED, which a parked run it replaces sees at once, and a job continued from an ended run goes back to
    that run, so the next try continues it again. A user's stop meanwhile stands."""
    job_name, run_id = admitted.job, admitted.run_id
    with session_scope(settings.database_url) as s:
        job = lock_row(s, Job, job_name)
        run = s.get(JobRun, run_id)
        before = s.get(JobRun, previous) if previous is not None else None
        assert run is not None
        if before is not None and job.current_run_id == run_id:
            own_job(s, job, before, f"the launch of run {run_id} failed; back to run {before.id}")
            if job.desired == Desired.RUN:  # what the launch set; a stop asked since is left as it is
                job.desired = admitted.desired_before
        if run.ended_at is not None:
            return
        run.state, run.ended_at, run.error = "FAILED", utcnow(), f"its launch failed before a driver ran: {exc}"
        audit.record(s, "job.launch", "job", job_name, outcome="failed", run=run_id, reason=run.error,
                     handed_back_to=previous)


def _submission(settings: Settings, python: str, master: Any, admitted: _Admitted, version: str,
                checkpoint_root: Path | None, *, standby: bool, allow_non_restored_state: bool) -> dict[str, Any]:
    """The master's REST CreateSubmissionRequest for a run's driver."""
    job_name, code, spark_settings = admitted.job, admitted.code, admitted.spark_settings
    if code is None or not Path(code).exists():
        raise ChangeoverError(f"launch of job {job_name}", f"its code artifact {code} is missing",
                              "submit the job again under a new name, or restore the artifact store")
    package, entry_script = runtime_artifacts(settings)
    env = {"PYSPARK_PYTHON": python, "CHANGEOVER_ACTOR": f"driver:{job_name}", **settings.as_env(),
           **faults.env()}
    confs = {
        "spark.pyspark.python": python,
        "spark.decommission.enabled": "true",
        "spark.ui.enabled": "false",
        "spark.sql.session.timeZone": "UTC",
        **admitted.state_store,
        **spark_settings.confs(),
    }
    app_args = ["--master", master_url(master), *spark_settings.submit_args([str(package), code])]
    for key, value in confs.items():
        app_args += ["--conf", f"{key}={value}"]
    app_args += [str(entry_script), "--job", job_name, "--run-id", str(admitted.run_id),
                 "--module", admitted.module, "--entry", admitted.entry, "--expected-version", version,
                 "--lease-seconds", str(admitted.lease_seconds),
                 "--stop-deadline", str(admitted.stop_deadline),
                 "--self-fence-seconds", str(lease.self_fence_seconds())]
    app_args += ["--checkpoint-root", str(checkpoint_root)] if checkpoint_root else []
    app_args += ["--standby"] if standby else []
    if admitted.state_partitions is not None:
        app_args += ["--state-partitions", str(admitted.state_partitions)]
    if allow_non_restored_state:
        app_args.append("--allow-non-restored-state")
    return {
        "action": "CreateSubmissionRequest",
        "appResource": f"file:{entry_script}",
        "mainClass": "org.apache.spark.deploy.SparkSubmit",
        "appArgs": app_args,
        "clientSparkVersion": version,
        "environmentVariables": env,
        "sparkProperties": {
            "spark.app.name": f"changeover-{job_name}",
            "spark.master": master_url(master),
            "spark.submit.deployMode": "cluster",
            "spark.driver.supervise": "false",
            "spark.driver.memory": spark_settings.driver_memory,
            "spark.driver.cores": "1",
        },
    }


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
    """Ask the run's master about its driver, and record what it says.

    Only the master's word ends a run, or a silence past `lost_after_seconds` from both the master and the
    driver's heartbeat: a master that is slow to answer says nothing about its drivers, so one unanswered
    query leaves the run as it was (observed UNKNOWN) and the next observation asks again.
    """
    with session_scope(settings.database_url) as s:
        run = s.get(JobRun, run_id)
        assert run is not None
        if run.submission_id is None and run.state == RunState.SUBMITTED and run.heartbeat_at is None:
            _unaccepted(s, run)
        if run.submission_id is None or not (run.state in (*LIVE, STANDBY) or run.parked):
            return run
        version, submission = run.spark_version, run.submission_id
    unanswered: str | None = None
    try:
        status: DriverStatus | None = membership.master(version).status(submission)
    except MasterUnreachable as exc:
        status, unanswered = None, exc.reason
    except NoMaster:
        status = None  # its group's master was stopped, and its drivers with it
    with session_scope(settings.database_url) as s:
        run = s.get(JobRun, run_id)
        assert run is not None
        if status is not None and status.worker_host:
            run.member = s.scalar(select(Member.name).where(Member.host == status.worker_host))
        observed = DRIVER_STATES.get(status.state) if status else (None if unanswered else "KILLED")
        if status is not None and status.state == "ERROR" and not run.error:
            run.error = "its master reports ERROR: its worker was lost, or the driver could not be started"
        if observed == "FAILED" and run.state in (*LIVE, STANDBY) and not run.error:
            # The driver records its own failures before it exits; one that ended FAILED without a word was
            # killed or crashed (kill -9, the OOM killer), so its checkpoint is as whole as after a kill.
            observed = "KILLED"
            run.error = checkpoints.read_gave_up(run.checkpoint_root) or (  # a driver that stood down, then gave up
                "its driver ended without reporting a failure of its own: killed, or its process crashed")
        if status is not None and status.state in ("SUBMITTED", "RELAUNCHING"):
            return run  # queued for cores, or being relaunched: alive in its master's word, however long it waits
        if observed is None:  # no word either way
            if run.parked:
                return run  # a parked driver ends itself, so only its master's word ends it here
            silent = (utcnow() - as_utc(run.heartbeat_at or run.submitted_at)).total_seconds()
            if silent < lease.lost_after_seconds():
                log.info("job %s run %s: state UNKNOWN (%s); asked again at the next observation", run.job,
                         run.id, unanswered or f"its master reports the driver as {status and status.state}")
                return run
            observed = "KILLED"
            run.error = f"lost: no word from its master ({unanswered or 'driver unknown'}) and no heartbeat " \
                        f"for {silent:.0f} s"
        if observed != "RUNNING" and run.parked:
            # its driver is gone; the checkpoint still ends on the batch boundary it parked at
            run.state, run.ended_at = RunState.STOPPED, utcnow()
            run.error = run.error or checkpoints.read_gave_up(run.checkpoint_root)  # a driver that gave up says why
            audit.record(s, "job.end", "job", run.job, run=run.id, state=RunState.STOPPED, driver=observed,
                         **({"reason": run.error} if run.error else {}))
        elif observed != "RUNNING" and run.state in (*LIVE, STANDBY):
            run.state, run.ended_at = observed, run.ended_at or utcnow()
            audit.record(s, "job.end", "job", run.job, run=run.id, state=observed,
                         **({"reason": run.error} if run.error else {}))
        elif observed == "RUNNING" and run.state == RunState.SUBMITTED and run.heartbeat_at is not None:
            run.state = RunState.RUNNING
        return run


def _unaccepted(s: Any, run: JobRun) -> None:
    """A run its launch created but whose driver was never heard of: its task died before the master answered,
    or the master never took it. Ended once that silence outlasts `lost_after_seconds`, so the parked run it
    would replace takes the job back; a driver that does start that late finds its run ended and exits."""
    silent = (utcnow() - as_utc(run.submitted_at)).total_seconds()
    laying_out = run.checkpoint_root and (Path(run.checkpoint_root) / LAYING_OUT).exists()
    if silent < lease.lost_after_seconds() or laying_out:
        return  # not yet silent long, or its launch still lays out its checkpoint (a large state copies slowly)
    error = f"never accepted: no submission id and no word from its driver for {silent:.0f} s"
    # Conditional, so a driver's first heartbeat and this cannot both win: the row lock orders them.
    ended = s.execute(update(JobRun).where(
        JobRun.id == run.id, JobRun.submission_id.is_(None), JobRun.heartbeat_at.is_(None), JobRun.ended_at.is_(None)
    ).values(state="KILLED", ended_at=utcnow(), error=error).execution_options(synchronize_session=False)).rowcount
    s.refresh(run)
    if ended:
        audit.record(s, "job.end", "job", run.job, run=run.id, state="KILLED", reason=error)


def parked_runs_on(settings: Settings, membership: Membership, member: str) -> list[JobRun]:
    """Runs parked on a member whose drivers still live: they exit once their successors write."""
    with session_scope(settings.database_url) as s:
        ids = list(s.scalars(select(JobRun.id).where(
            JobRun.member == member, JobRun.state.in_(PARKED_FORMS), JobRun.ended_at.is_(None))))
    return [run for run in (observe(settings, membership, i) for i in ids) if run.parked]


def drivers_on(settings: Settings, membership: Membership, member: str) -> list[JobRun]:
    """Runs whose drivers still live on a member, running or parked: the one query a restart of its worker must
    ask, since a parked run may resume between two narrower looks."""
    with session_scope(settings.database_url) as s:
        ids = list(s.scalars(select(JobRun.id).where(JobRun.member == member, JobRun.ended_at.is_(None))))
    return [run for run in (observe(settings, membership, i) for i in ids) if run.ended_at is None]


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
        job = lock_row(s, Job, job_name)
        run = current_run(s, job)
        if run is None or run.state not in LIVE or run.submission_id is None:
            return
        # First, under the job's lock: a cancel is someone's intent, and no drain, rebalance or abort that sees
        # the run end afterwards brings the job back.
        job.desired = Desired.STOP
        version, submission, run_id = run.spark_version, run.submission_id, run.id
    _kill(settings, membership, run_id, version, submission, "KILLED", reason, "job.cancel")


def end_for_restart(settings: Settings, membership: Membership, run_id: int, reason: str) -> None:
    """End a fault-tolerant run's driver so that it can go on from its checkpoint elsewhere or after its worker's
    restart; unlike a cancel, the job stays wanted (desired RUN). A parked run ends STOPPED on its boundary."""
    with session_scope(settings.database_url) as s:
        run = s.get(JobRun, run_id)
        assert run is not None
        if run.ended_at is not None or run.submission_id is None:
            return
        version, submission, parked = run.spark_version, run.submission_id, run.parked
    _kill(settings, membership, run_id, version, submission, "STOPPED" if parked else "KILLED", reason, "job.end")


def dismiss_standby(settings: Settings, membership: Membership, run_id: int, reason: str) -> bool:
    """End a warm standby that will not be handed its job (not ready in time, or its move was withdrawn). It never
    ran a query, so it ends STOPPED with the reason; a driver not yet started finds its run ended and exits.
    False when it was handed its job meanwhile: then it is the job's run, and stays."""
    with session_scope(settings.database_url) as s:
        run = s.get(JobRun, run_id)
        assert run is not None
        job, version, submission = run.job, run.spark_version, run.submission_id
    if not lease.end_standby(settings.database_url, job, run_id, reason, "job.standby.dismiss"):
        with session_scope(settings.database_url) as s:  # ended already, or handed the job meanwhile
            return get_job(s, job).current_run_id != run_id
    if submission is not None:  # one not yet started finds its run ended and exits
        kill_driver(membership.master(version), submission, f"the driver of standby run {run_id}")
    return True


def _kill(settings: Settings, membership: Membership, run_id: int, version: str, submission: str, state: str,
          reason: str, action: str) -> None:
    """Kill a live run's driver through its master and record the run as `state`, whatever the dying driver wrote
    meanwhile (a query started as its SparkContext stopped reports FAILED): the end is ours, and its checkpoint
    ends on its last commit, or on the boundary it parked at. Returns once the master says the driver has ended,
    so a resubmit may then take over its checkpoint."""
    asked = utcnow()
    kill_driver(membership.master(version), submission, f"the driver of run {run_id}")
    with session_scope(settings.database_url) as s:
        run = s.get(JobRun, run_id)
        assert run is not None
        if run.ended_at is None or as_utc(run.ended_at) >= asked:  # an end the run recorded before is its own
            said = (run.error or "").splitlines()[0][:300] if run.error else "no reason"
            written = f" (its driver wrote, dying: {run.state}, {said})" if run.ended_at is not None else ""
            run.state, run.error = state, reason + written
            run.ended_at, run.lease_until = run.ended_at or utcnow(), None
        audit.record(s, action, "job", run.job, run=run_id, state=run.state, reason=reason)


def kill_driver(master: Any, submission: str, what: str) -> None:
    """Kill a driver through its master; returns once the master says it has ended."""
    master.kill(submission)
    wait_for(lambda: master.status(submission).state not in ("SUBMITTED", "RUNNING", "RELAUNCHING"), 120,
             f"{what} ending after its kill")


def continue_ended_on(settings: Settings, membership: Membership, member: str, since: datetime | None) -> list[str]:
    """Fault-tolerant jobs still wanted whose current run ended on `member` since `since` (its drain's start) without
    failing on its own code (killed, or stopped for a move that was withdrawn) go on from their checkpoints at the
    version they ran: the same version, so a new one that failed them is not tried again here. A run that ended
    before the drain (a job someone left down) is left alone, and a job another launch continued first is skipped."""
    if since is None:
        return []
    with session_scope(settings.database_url) as s:
        ended = list(s.scalars(select(JobRun).join(Job, Job.current_run_id == JobRun.id).where(
            Job.fault_tolerant.is_(True), Job.desired == Desired.RUN, JobRun.member == member,
            JobRun.ended_at >= since, JobRun.state.in_((RunState.KILLED, RunState.STOPPED)))))
    continued = []
    for run in ended:
        root = checkpoints.new_checkpoint_root(settings, run.job)
        try:
            launch(settings, membership, run.job, run.spark_version, root, ContinueRun(run.id), copy_from=run)
        except ChangeoverError as exc:  # another launch went first, or its driver is not gone yet
            log.warning("job %s: not continued from run %s: %s", run.job, run.id, exc)
            continue
        continued.append(run.job)
    return continued


def list_jobs(settings: Settings) -> list[dict[str, Any]]:
    with session_scope(settings.database_url) as s:
        rows = []
        standbys = {r.standby_of: r for r in s.scalars(select(JobRun).where(JobRun.standby_of.is_not(None),
                                                                             JobRun.ended_at.is_(None)))}
        for job in s.scalars(select(Job).order_by(Job.name)):
            run = current_run(s, job)
            standby = standbys.get(run.id) if run else None
            rows.append({
                "name": job.name, "module": job.module, "entry": job.entry, "fault_tolerant": job.fault_tolerant,
                "block_shutdown": job.block_shutdown, "shutdown_timeout": job.shutdown_timeout,
                "state": run.state if run else "NEW", "version": run.spark_version if run else None,
                "member": run.member if run else None, "run": run.id if run else None,
                "progress": run.progress if run else {},
                # a warm successor holding a driver and an executor on its member until the handoff
                "standby": (f"run {standby.id} on {standby.member or 'its master'} at {standby.spark_version}, "
                            f"{'ready' if standby.ready_at else 'warming'}") if standby else None,
            })
        return rows
