"""Launching a job's runs: submit and resume, each launch for one of its intents (`jobs.intents`) with its run
admitted under the job's lock, the ended run's checkpoint laid out for the run that goes on from it, the master's
REST submission, and a launch that fails handed back."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import select

from changeover import audit, faults
from changeover.cluster import Membership, NoMaster, routing
from changeover.cluster.shipping import runtime_artifacts, store_job_code
from changeover.cluster.spark_master import MasterUnreachable
from changeover.cluster.spark_settings import SparkSettings
from changeover.compat import rescale_check
from changeover.compat.version_table import require_resumable
from changeover.errors import ChangeoverError
from changeover.handoff import lease
from changeover.handoff.ownership import own_job
from changeover.jobs.intents import START, ContinueRun, Intent, Standby
from changeover.names import check_name
from changeover.registry.db import lock_row, session_scope
from changeover.registry.models import Job, JobRun, utcnow
from changeover.registry.records import LIVE, STANDBY, current_run, get_job
from changeover.registry.states import Desired, RunState
from changeover.runtime import checkpoints
from changeover.runtime.state_partitions import state_store_confs
from changeover.savepoints import get_savepoint, restore
from changeover.settings import Settings

log = logging.getLogger("changeover.jobs")


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
        return _submit_from_savepoint(settings, membership, name, version, from_savepoint, rename_stages,
                                      allow_non_restored_state, rewind_sink, accept_duplicates, state_partitions)
    root = checkpoints.new_checkpoint_root(settings, name)
    if continues is None or not continues.checkpoint_root or not Path(continues.checkpoint_root).is_dir():
        continues = None
    return launch(settings, membership, name, version, root, copy_from=continues)


def _submit_from_savepoint(settings: Settings, membership: Membership, name: str, version: str, from_savepoint: str,
                           rename_stages: dict[str, str] | None, allow_non_restored_state: bool, rewind_sink: bool,
                           accept_duplicates: bool, state_partitions: int | None) -> JobRun:
    """`submit`'s launch from a savepoint (NAME, or JOB/NAME of another job), once it is checked resumable on
    `version` (and, with `state_partitions`, repartitionable): restored into a fresh checkpoint root first."""
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
