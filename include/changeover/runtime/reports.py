"""What a driver reports of its run to the registry, and reads back of it: heartbeats, progress, failures, its
stages' operators and plans, a rescale, a stop that failed (`RunReports`, the base of `runtime.loop.Driver`).
"""

from __future__ import annotations

import logging
import time
from functools import partial
from pathlib import Path
from typing import Any

from sqlalchemy import update

from changeover import audit, faults
from changeover.handoff import lease
from changeover.registry.db import lock_row, patiently, session_scope
from changeover.registry.models import Job, JobRun, utcnow
from changeover.registry.states import LIVE, Desired, RunState
from changeover.runtime import plan, state_partitions
from changeover.runtime.contract import Stage
from changeover.runtime.follower import InQueryReplay
from changeover.runtime.queries import StageQueries
from changeover.settings import Settings
from changeover.timeutil import as_utc

log = logging.getLogger("changeover.driver")


class RunReports:
    """A driver's run as the registry keeps it: what the driver reports of it, and reads back. The base of
    `Driver` (`runtime.loop`: the running loop and the park), through `Standby` (`runtime.standby`)."""

    def __init__(self, settings: Settings, job: str, run_id: int, lease_seconds: float | None = None,
                 stop_deadline: float = 60.0, self_fence_seconds: float | None = None) -> None:
        self.settings = settings
        self.lease_seconds = lease_seconds if lease_seconds is not None else lease.lease_seconds()
        self.stop_deadline = stop_deadline
        self.self_fence_seconds = self_fence_seconds if self_fence_seconds is not None else lease.self_fence_seconds()
        self.url = settings.database_url
        self.job = job
        self.run_id = run_id
        self._unanswered_since: float | None = None  # when the parked run's registry calls began to fail
        self._queries: StageQueries | None = None  # the running loop's, for standing down
        self._confirmed_at = time.monotonic()  # when the registry last said this run is its job's current one
        self._stood_down_at: float | None = None
        self._checkpoint_root: Path | None = None
        self._beaten = 0.0  # when a cut-over's step last heartbeat
        self._in_query_replay: InQueryReplay | None = None  # a follower's queries primed in place: on every start

    def record_submission(self, cwd: Path) -> None:
        """The second half of a launch whose answer was lost (its task killed after the master accepted it):
        a worker runs each driver in a folder named by its submission id, so the driver can name it itself."""
        if not cwd.name.startswith("driver-"):
            return
        with session_scope(self.url) as s:
            run = s.get(JobRun, self.run_id)
            if run is not None and run.submission_id is None:
                run.submission_id = cwd.name
                audit.record(s, "job.submission_reconciled", "job", self.job, run=self.run_id, submission=cwd.name)

    def heartbeat(self) -> bool:
        """False when the run has ended already (e.g. recorded as never accepted before this driver started)."""
        with session_scope(self.url) as s:
            # conditional, against the control plane ending a run it never heard of (`jobs.observing._unaccepted`)
            return bool(s.execute(update(JobRun).where(JobRun.id == self.run_id, JobRun.ended_at.is_(None))
                                  .values(heartbeat_at=utcnow())).rowcount)

    def fail(self, message: str) -> None:
        with session_scope(self.url) as s:
            run = s.get(JobRun, self.run_id)
            if run and run.ended_at is None:  # not a run already ended, e.g. cancelled, whose driver dies now
                run.state, run.error, run.ended_at = "FAILED", message, utcnow()
            audit.record(s, "job.fail", "job", self.job, outcome="failed", run=self.run_id, error=message)

    def lost_jvm(self, message: str) -> None:
        with session_scope(self.url) as s:
            run = s.get(JobRun, self.run_id)
            if run and run.ended_at is None:
                run.state, run.error, run.ended_at = "KILLED", message, utcnow()
            audit.record(s, "job.end", "job", self.job, outcome="killed", run=self.run_id, state="KILLED",
                         reason=message)

    def options(self) -> dict[str, Any]:
        with session_scope(self.url) as s:
            job = s.get(Job, self.job)
            return dict(job.options) if job else {}

    @property
    def registry(self) -> str:
        return f"job {self.job} run {self.run_id}: the registry"

    def stop_state(self) -> str:
        """"fenced" once another run is the job's current one, or this run is recorded as ended (the control plane
        declared it lost), else the job's desired state: RUN, STOP or MOVE."""
        with session_scope(self.url) as s:
            job = s.get(Job, self.job)
            run = s.get(JobRun, self.run_id)
            if job is None or job.current_run_id != self.run_id or run is None or run.ended_at is not None:
                return "fenced"
            return job.desired

    def report(self, progress: dict[str, int | None], committed: bool, state: str = "RUNNING",
               **fields: Any) -> None:
        with session_scope(self.url) as s:
            run = s.get(JobRun, self.run_id)
            assert run is not None
            now = utcnow()
            run.heartbeat_at, run.progress = now, dict(progress)
            for name, value in fields.items():
                setattr(run, name, value)
            if run.state in LIVE or (run.state == RunState.PARKED and state == RunState.STOPPED):
                run.state = state
            if committed:
                run.last_commit_at = now
                run.first_commit_at = run.first_commit_at or now
            if state != "RUNNING":
                run.ended_at = now
                audit.record(s, "job.stop", "job", self.job, run=self.run_id, state=state, progress=progress)

    def seconds_since_launch(self) -> float:
        with session_scope(self.url) as s:
            run = s.get(JobRun, self.run_id)
            assert run is not None
            return (utcnow() - as_utc(run.submitted_at)).total_seconds()

    def mark_first_trigger(self) -> None:
        """Every query has finished a trigger since the start: a drain holding its member's restart for this
        run's first batch can stop waiting, whether that batch had input or found none."""
        with session_scope(self.url) as s:
            s.execute(update(JobRun).where(JobRun.id == self.run_id, JobRun.first_trigger_at.is_(None))
                      .values(first_trigger_at=utcnow()))

    def report_operators(self, spark: Any, checkpoint_root: Path, stages: list[str]) -> None:
        """Record each stage's stateful operators as Spark's `state-metadata` reader sees them.

        Read once a stage has committed a batch (the reader needs one), so a savepoint's manifest
        can say which operators its state belongs to without starting Spark itself.
        """
        found: dict[str, Any] = {}
        for stage in stages:
            if not (checkpoint_root / stage / "state").is_dir():
                found[stage] = []  # a stateless stage
                continue
            rows = spark.read.format("state-metadata").load(str(checkpoint_root / stage)).collect()
            found[stage] = [row.asDict(recursive=True) for row in rows]
        with session_scope(self.url) as s:
            run = s.get(JobRun, self.run_id)
            assert run is not None
            run.operators = {**(run.operators or {}), **found}

    def describe(self, spark: Any, stages: list[Stage]) -> dict[str, Any] | None:
        """The stages' stateful plans for later savepoints' manifests. A plan Changeover cannot read costs the
        compatibility check detail (it falls back to the state schemas), never the job."""
        if spark is None:
            return None
        try:
            return plan.describe_stages(spark, stages)
        except Exception as exc:  # noqa: BLE001 - py4j surfaces JVM errors of any kind
            log.warning("job %s run %s: its stage plans were not recorded (%s)", self.job, self.run_id, exc)
            return None

    def rescale(self, spark: Any, checkpoint_root: Path, count: int, stages: list[str]) -> None:
        """Repartition the state of each restored stage the job builds to `count` partitions before any query
        starts: this run's own checkpoint, laid out from a savepoint that stays as it was. A failure fails the run;
        the job resumes from the savepoint again, or a run continuing this one finishes the repartition. No
        savepoint is taken of the root meanwhile (the marker)."""
        marker = checkpoint_root / state_partitions.RESCALING
        marker.touch()
        for stage in [name for name in stages if (checkpoint_root / name).is_dir()]:
            started = time.monotonic()
            moved = state_partitions.rescale(spark, checkpoint_root / stage, count)
            if moved is None:
                continue
            before, batch = moved
            seconds = round(time.monotonic() - started, 2)
            log.info("job %s run %s: stage %s state %s -> %s partitions (batch %s, %.1f s)", self.job, self.run_id,
                     stage, before, count, batch, seconds)
            patiently(partial(self._record_rescale, stage, before, count, batch, seconds), self.registry)
            faults.reached_in_job("rescale.stage_done", stage)
        marker.unlink()

    def _record_rescale(self, stage: str, before: int, count: int, batch: int, seconds: float) -> None:
        with session_scope(self.url) as s:
            audit.record(s, "job.rescale", "job", self.job, run=self.run_id, stage=stage, partitions_before=before,
                         partitions=count, batch=batch, seconds=seconds)

    def stop_failed(self, wanted: str) -> None:
        """Past the hard deadline a trigger was still active: the stop is withdrawn and the job runs on."""
        with session_scope(self.url) as s:
            job = lock_row(s, Job, self.job)
            if job is not None and job.current_run_id == self.run_id and job.desired == wanted:
                job.desired = Desired.RUN
            run = s.get(JobRun, self.run_id)
            if run is not None:
                run.stopping_after = None  # its follower must not take the batch it named for its last
            audit.record(s, "job.stop_failed", "job", self.job, outcome="failed", run=self.run_id,
                         reason=f"a batch was still running {self.stop_deadline:.0f} s after the stop began to wait "
                         "for it; the job keeps running")
