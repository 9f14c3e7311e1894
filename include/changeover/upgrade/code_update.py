"""A job's code update, step by step, each step safe to repeat: check, stop with a savepoint, resume on the
new code, a stability gate, and a rollback to the old code from the same savepoint."""

from __future__ import annotations

import logging
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from changeover import audit, jobs, savepoints
from changeover.cluster import Membership, routing, wait_for
from changeover.cluster.shipping import JobCode, store_job_code
from changeover.compat.checker import Report
from changeover.compat.static_check import check_code
from changeover.compat.version_table import require_resumable
from changeover.errors import ChangeoverError
from changeover.registry.db import lock_row, session_scope
from changeover.registry.models import Job, JobRun, Savepoint, utcnow
from changeover.registry.states import Desired
from changeover.runtime import checkpoints, state_partitions
from changeover.settings import Settings
from changeover.timeutil import as_utc
from changeover.upgrade import relocate, warm, zero_downtime

Code = str | dict[str, str]  # new code to ship (a path or module), or code already shipped (current_code)
UPDATE_STRATEGIES = ("stop", "zero_downtime")
log = logging.getLogger(__name__)


def current_code(settings: Settings, job: str) -> dict[str, str]:
    """The job's shipped code, as a rollback puts it back."""
    with session_scope(settings.database_url) as s:
        return jobs.get_job(s, job).code_of()


def shipped(settings: Settings, job: str, code: Code) -> JobCode:
    if isinstance(code, dict):
        return JobCode(code["module"], code["entry"], Path(code["code"]))
    return store_job_code(settings, job, code)


def ship(settings: Settings, job: str, code: str) -> dict[str, str]:
    """Freeze new code once, as it is checked: later steps use this artifact, not the path again."""
    new = store_job_code(settings, job, code)
    return {"code": str(new.artifact), "module": new.module, "entry": new.entry}


def not_checkable(settings: Settings, membership: Membership, job: str) -> str | None:
    """Why a version upgrade has nothing of this job's to check, if so: no running streaming state."""
    run = jobs.refresh(settings, membership, job)
    with session_scope(settings.database_url) as s:
        entry = jobs.get_job(s, job).entry
    if entry != "build":
        return "a batch job keeps no state between runs"
    if run is None or run.state not in jobs.LIVE:
        return (f"it is not running ({run.state if run else 'no run'}), so the upgrade moves none of its state; "
                "check its savepoint with `changeover check` before resuming it")
    if not any(batch is not None for batch in (run.progress or {}).values()):
        return "it has committed no batch yet, so it has no state to move"
    return None


def check(settings: Settings, job: str, code: str | None, name: str, renames: dict[str, str] | None = None,
          dry_run: bool = True, strict: bool = False, target_version: str | None = None,
          state_partitions: int | None = None) -> Report:
    """A `continue` savepoint (the same one on a retry), the static check and the dry run against it, on the
    version the job would resume on, then the savepoint is deleted. The running job is not touched. With
    `state_partitions`, whether each stage's state can move to that count, replayed on a repartitioned copy."""
    check_savepoint(settings, job, name)
    target = target_version or routing.target_version(settings)
    report = check_code(settings, code, f"{job}/{name}", target, renames, dry_run=dry_run, strict=strict,
                        state_partitions=state_partitions)
    savepoints.delete(settings, job, name)  # only the check needed it; kept, it would count against retention
    return report


def check_savepoint(settings: Settings, job: str, name: str) -> Savepoint:
    """The check's `continue` savepoint: an earlier try's while it still verifies, else taken (again). A retry
    that reused one no longer usable (a file changed under it) would fail the same way on every try."""
    with session_scope(settings.database_url) as s:
        earlier = savepoints.completed_in(s, job, name)
        path = Path(earlier.path) if earlier is not None else None
    if path is not None:
        try:
            savepoints.verify(path)
        except ChangeoverError as exc:
            log.warning("savepoint %s of job %s, left by an earlier try of the check, is taken again: %s",
                        name, job, exc)
            savepoints.delete(settings, job, name)
    return savepoints.take(settings, job, name, mode="continue", exist_ok=True)


def switch_code(settings: Settings, job_name: str, code: Code, why: str) -> bool:
    """Point the job at other code for its next launch. False if it already has that code."""
    new = shipped(settings, job_name, code)
    with session_scope(settings.database_url) as s:
        job = lock_row(s, Job, job_name)
        if job is None:
            jobs.get_job(s, job_name)  # refuses with the known jobs
            raise AssertionError("unreachable")
        run = jobs.current_run(s, job)
        if run is not None and (run.state in jobs.LIVE or run.parked):
            raise ChangeoverError(f"code change of job {job_name}", f"its run {run.id} is still {run.state}, and "
                                  "a running driver keeps the code it started with",
                                  "stop the job with a savepoint first (the update_job DAG does)")
        if job.code == str(new.artifact):
            return False
        audit.record(s, "job.update_code", "job", job_name, before=job.code, after=str(new.artifact), reason=why)
        job.module, job.code, job.entry = new.module, str(new.artifact), new.entry
        return True


def live_run_on(settings: Settings, membership: Membership, job: str, code: dict[str, str] | None) -> JobRun | None:
    """The job's current run if it is live on `code` (None: on any code)."""
    current = jobs.refresh(settings, membership, job)
    return current if current is not None and current.state in jobs.LIVE and warm.runs_code(current, code) else None


def outcome(refused_at_check: bool, resumed: bool, stable: bool, rolled_back: bool, old_code_runs: bool) -> str:
    """An update's outcome in a word or a sentence, from what its tasks did and whether the job's live run is on
    the code before the update."""
    if rolled_back:
        return "rolled back"
    if stable:
        return "updated"
    if refused_at_check:
        return "stopped at the check"
    if not resumed and old_code_runs:  # a stop given up, a follower that did not catch up in time
        return "not resumed: the job runs its old code"
    if not old_code_runs:  # stopped, and neither the new code nor the rollback runs it
        return "failed: the job is not running its old code; see the rollback task, and resume it from the savepoint"
    return "failed"


def strategy_of(asked: str | None, options: dict[str, Any]) -> str:
    """An update's strategy: the one asked for (the DAG's Param), else zero_downtime where the job's option
    move_strategy says so, else stop (stop with a savepoint, then resume on the new code)."""
    chosen = asked or ("zero_downtime" if options.get("move_strategy") == "zero_downtime" else "stop")
    if chosen not in UPDATE_STRATEGIES:
        raise ChangeoverError(f"update strategy {chosen!r}", f"the strategies are {', '.join(UPDATE_STRATEGIES)}",
                              "pick one of them (the DAG's strategy Param, or the job's option move_strategy)")
    return chosen


def zero_downtime_refusal(renames: dict[str, str] | None, allow_non_restored_state: bool,
                          state_partitions: int | None) -> str | None:
    """Why an update cannot go zero-downtime, or None: its follower replays the running job's batches on the new
    code, so each stage must keep its name, its state and its partitions."""
    if renames:
        return f"it renames stages ({', '.join(f'{a} -> {b}' for a, b in renames.items())})"
    if allow_non_restored_state:
        return "it drops state (allow_non_restored_state)"
    if state_partitions:
        return f"it repartitions the state (state_partitions {state_partitions})"
    return None


def require_followable(job: str, renames: dict[str, str] | None, allow_non_restored_state: bool,
                       state_partitions: int | None) -> None:
    """Refuses, by `zero_downtime_refusal`, an update whose follower could not replay the job batch by batch."""
    why = zero_downtime_refusal(renames, allow_non_restored_state, state_partitions)
    if why is not None:
        raise ChangeoverError(f"zero-downtime update of job {job}", why, "update it with the strategy stop, which "
                              "stops the job with a savepoint and resumes it on the new code")


def cut_over(settings: Settings, membership: Membership, job: str, code: Code, savepoint: str,
             catch_up: zero_downtime.CatchUp, renames: dict[str, str] | None = None,
             allow_non_restored_state: bool = False, state_partitions: int | None = None) -> JobRun | None:
    """The next step of a zero-downtime update: a follower on the new code replays the running job's
    batches read-only from a `continue` savepoint, and once it has caught up it takes over from the next batch; the
    job never stops before then. The old run's savepoint at the cut-over is `savepoint`, as after a stop, so the
    gate counts from it and a rollback resumes it. Returns the new run once it owns the job, None while the job
    runs on as it is. Safe to repeat (`relocate.step`)."""
    require_followable(job, renames, allow_non_restored_state, state_partitions)
    new = shipped(settings, job, code)
    wanted = {"code": str(new.artifact), "module": new.module, "entry": new.entry}
    relocate.step(settings, membership, job, routing.target_version(settings), reason="update",
                  strategy="zero_downtime", catch_up=catch_up, code=wanted, savepoint_name=savepoint)
    # only a run of the new code: a parked run that took the job back, or one continued from a killed run's
    # checkpoint, runs the old one, and the next step tries again
    return live_run_on(settings, membership, job, wanted)


def cut_over_due(settings: Settings, membership: Membership, job: str, catch_up: zero_downtime.CatchUp) -> bool:
    """Whether `cut_over` has a step to take now: not while the job's follower starts, or replays behind it within
    its catch-up (a trigger waits that out)."""
    run = jobs.refresh(settings, membership, job)
    return run is None or run.state not in jobs.LIVE or not zero_downtime.waiting_on_successor(
        settings, membership, run, catch_up)


def resume_with(settings: Settings, membership: Membership, job: str, code: Code, savepoint: str,
                renames: dict[str, str] | None = None, allow_non_restored_state: bool = False,
                rewind_sink: bool = False, why: str = "update", state_partitions: int | None = None) -> JobRun:
    """The job on `code`, resumed from its savepoint. A run launched from that savepoint on that code is
    returned as it is, whatever its state: a retried task never launches twice. Only a run this update
    launched (from the same savepoint) is ever replaced, and only once the savepoint is known to be usable."""
    with session_scope(settings.database_url) as s:
        row = jobs.get_job(s, job)
        run = jobs.current_run(s, row)
        saved = savepoints.get_savepoint(s, job, savepoint)
        # launched from the savepoint, or (a zero-downtime update) the follower that took over from its run
        ours = run is not None and run.submission_id is not None and (
            run.from_savepoint == savepoint or (run.standby_of is not None and run.standby_of == saved.run_id))
        if ours and row.code == str(shipped(settings, job, code).artifact) and run.state_partitions == state_partitions:
            assert run is not None
            s.expunge(run)
            return run
        live = run is not None and (run.state in jobs.LIVE or run.parked)
        if live and not ours:
            assert run is not None
            raise ChangeoverError(f"{why} of job {job}", f"its run {run.id} ({run.state}) was started meanwhile, "
                                  "not by this update", "leave it running, or stop it with a savepoint and start "
                                  "the update again")
        path, written_by = Path(saved.path), saved.spark_version
    savepoints.verify(path)  # before anything is replaced: a corrupted savepoint stops here
    require_resumable(written_by, routing.target_version(settings), f"{why} of job {job} from {savepoint}")
    if live:
        jobs.cancel(settings, membership, job, reason=f"{why}: replaced by a run of other code")
    switch_code(settings, job, code, why)
    return jobs.resume(settings, membership, job, savepoint, rename_stages=renames,
                       allow_non_restored_state=allow_non_restored_state, rewind_sink=rewind_sink,
                       state_partitions=state_partitions)


def rollback(settings: Settings, membership: Membership, job: str, old_code: dict[str, str], savepoint: str,
             why: str) -> JobRun | None:
    """Back to the old code from the update's savepoint, with the sinks rewound to its batch so that the new
    code's writes are replaced by the old code's. None when the job never left its old code (the check failed,
    or the stop was given up); a stop requested but not completed is waited for, then undone by a resume."""
    current = jobs.refresh(settings, membership, job)
    if current is not None and not warm.runs_code(current, old_code):
        # a zero-downtime update's follower on the new code took over, and its try died before the savepoint
        relocate.settle_cut_over(settings, job, current, "update", None, savepoint)
    with session_scope(settings.database_url) as s:
        row = jobs.get_job(s, job)
        run = jobs.current_run(s, row)
        live = run is not None and (run.state in jobs.LIVE or run.parked)
        from_update = run is not None and run.from_savepoint == savepoint
        saved = savepoints.completed_in(s, job, savepoint)
        root = run.checkpoint_root if run is not None else None
        # an update may keep the code and change only the state's partitions: told by the state itself, whichever
        # run (the update's, one continuing it, a move's) holds it now
        rescaled = saved is not None and root is not None and repartitioned_since(Path(saved.path), Path(root))
        desired, on_old_code = row.desired, row.code == old_code["code"] and not rescaled
    if on_old_code and live and from_update:
        return jobs.refresh(settings, membership, job)  # rolled back by an earlier try
    if on_old_code and live and desired != Desired.STOP:
        assert run is not None
        standby = warm.standby_of(settings, membership, run.id)
        if standby is not None:  # a zero-downtime update's follower, not handed the job: it ends, unused
            zero_downtime.abort(settings, membership, job, standby, f"the update was rolled back: {why}")
        if desired == Desired.MOVE:  # asked to park for that follower: it runs on, not after a lease
            relocate.withdraw(settings, membership, job, f"the update was rolled back: {why}")
        return None
    if on_old_code and live:  # the update's stop is under way: let it end at its boundary, then resume
        wait_for(lambda: (r := jobs.refresh(settings, membership, job)) is None or r.state not in jobs.LIVE,
                 180, f"job {job} stopping at its batch boundary before its rollback")
    with session_scope(settings.database_url) as s:
        taken = savepoints.completed_in(s, job, savepoint) is not None
        run = jobs.current_run(s, jobs.get_job(s, job))
        from_update = run is not None and run.from_savepoint == savepoint
    if taken:
        run = resume_with(settings, membership, job, old_code, savepoint, rewind_sink=True, why=f"rollback: {why}")
    elif from_update:
        raise ChangeoverError(f"rollback of job {job}", f"its update savepoint {savepoint!r} is gone, and its "
                              "checkpoint now holds the new code's state", f"resume it by hand from an earlier "
                              f"savepoint: `changeover savepoints --job {job}`, then `changeover submit "
                              f"{old_code['code']} --name {job} --from-savepoint NAME --rewind-sink`")
    else:  # stopped before the savepoint was taken: the old code goes on from its own run's checkpoint
        switch_code(settings, job, old_code, f"rollback: {why}")
        run = jobs.submit(settings, membership, old_code["code"], job)
    with session_scope(settings.database_url) as s:
        audit.record(s, "job.rollback", "job", job, to_code=old_code["code"], run=run.id,
                     savepoint=savepoint if taken else None, reason=why)
    return run


def repartitioned_since(savepoint: Path, root: Path) -> bool:
    """Whether a stage's state in the checkpoint `root` has another count of partitions than in the savepoint."""
    for stage in checkpoints.stage_names(savepoint / "stages"):
        before = state_partitions.partitions(savepoint / "stages" / stage)
        now = state_partitions.partitions(root / stage)
        if before is not None and now is not None and before != now:
            return True
    return False


@dataclass(frozen=True)
class Stability:
    stable: bool
    reason: str
    run: int
    batches: int  # committed by the run since its restore, the fewest of its stages
    lag_seconds: float | None  # age of its last commit
    ended: bool = False  # the run is no longer live: waiting longer cannot make it stable
    launched_at: float | None = None  # the run's launch (epoch seconds): the gate's deadline counts from it


def stability(settings: Settings, membership: Membership, job: str, savepoint: str, batches: int,
              max_lag_seconds: float, renames: dict[str, str] | None = None) -> Stability:
    """Whether the job's current run has committed `batches` batches in every stage since the savepoint it was
    resumed from, has not failed, and its last commit is younger than `max_lag_seconds` (it keeps up)."""
    run = jobs.refresh(settings, membership, job)
    if run is None:
        raise ChangeoverError(f"stability of job {job}", "it has no run", "resume it first")
    with session_scope(settings.database_url) as s:
        row = savepoints.get_savepoint(s, job, savepoint)
        saved, taken_at, saved_of = row.stages or {}, as_utc(row.created_at).timestamp(), row.run_id
    start = {(renames or {}).get(stage, stage): batch for stage, batch in saved.items()}
    progress = run.progress or {}
    root = Path(run.checkpoint_root) if run.checkpoint_root else None

    def done_in(stage: str) -> int:
        done = (progress[stage] if progress.get(stage) is not None else -1) - start.get(stage, -1)
        if root is not None and stage in start and state_partitions.is_repartition(root / stage, start[stage] + 1):
            done -= 1  # a repartition's own batch reads no input: not one the new run proved itself on
        return done

    done = min((done_in(stage) for stage in progress), default=0)
    lag = (utcnow() - as_utc(run.last_commit_at)).total_seconds() if run.last_commit_at else None
    # a zero-downtime update's run was launched long before its savepoint, taken at its cut-over: its time counts
    # from then
    launched = max(as_utc(run.submitted_at).timestamp(), taken_at)
    seen = {"run": run.id, "batches": done, "lag_seconds": lag, "launched_at": launched}
    if run.state not in jobs.LIVE:
        return Stability(False, f"run {run.id} is {run.state}: {gist(run.error)}", ended=True, **seen)
    if run.id == saved_of:  # a zero-downtime update's follower failed before it wrote: the old code took the job back
        return Stability(False, f"run {run.id}, whose savepoint {savepoint} this is, runs the job again: the run of "
                         "the new code ended before it wrote anything", ended=True, **seen)
    if done < batches:
        return Stability(False, f"{done} of {batches} batches committed", **seen)
    if lag is None or lag > max_lag_seconds:
        return Stability(False, f"its last commit is {lag or 0:.0f} s old, over {max_lag_seconds:.0f} s", **seen)
    return Stability(True, f"{done} batches committed, the last {lag:.1f} s ago", **seen)


def gist(error: str | None) -> str:
    """The line of a driver's error that says what went wrong: Spark's error class and message, if it has one."""
    lines = [line.strip() for line in (error or "").splitlines() if line.strip()]
    if not lines:
        return "no error recorded"
    classed = [line for line in lines if re.search(r"\[[A-Z_]{6,}\]", line)]
    return (classed[-1] if classed else lines[-1])[:300]


def record_gate(settings: Settings, job: str, result: Stability) -> None:
    with session_scope(settings.database_url) as s:
        audit.record(s, "job.stability", "job", job, outcome="passed" if result.stable else "failed",
                     **asdict(result))


def downtime(settings: Settings, job: str, savepoint: str) -> float | None:
    """Seconds from the last commit of the run the savepoint was taken of to the first commit of the job's
    current run, resumed from it."""
    with session_scope(settings.database_url) as s:
        current = jobs.current_run(s, jobs.get_job(s, job))
        row = savepoints.get_savepoint(s, job, savepoint)
        before = s.get(JobRun, row.run_id) if row.run_id else None
        if current is None or before is None or not current.first_commit_at or not before.last_commit_at:
            return None
        return (as_utc(current.first_commit_at) - as_utc(before.last_commit_at)).total_seconds()
