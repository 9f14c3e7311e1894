"""The runtime wrapper that runs inside the Spark driver.

It checks the Spark version it was launched for before anything runs, runs the job's stages in
AvailableNow cycles so that every cycle ends on a committed batch boundary, reports heartbeats and
committed batches to the registry, and parks at a boundary when a stop is asked for (see `lease`).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession
from sqlalchemy.exc import OperationalError

from changeover import audit, checkpoints, lease
from changeover.checkpoints import last_commit
from changeover.registry.db import session_scope
from changeover.registry.models import STOPPING, Job, JobRun, utcnow
from changeover.settings import Settings
from changeover.sink import write_batch
from changeover.stages import JobContext, Stage

log = logging.getLogger("changeover.driver")


def unmatched_state(job: str, restored: set[str], stages: set[str]) -> str | None:
    """Seed 002's rules: a new stage starts empty, a matching one is restored, and state of a stage the
    job no longer has is an error unless allow_non_restored_state is given (as in Flink)."""
    orphaned = sorted(restored - stages)
    if not orphaned:
        return None
    return (
        f"job {job}: refused to start: the savepoint holds state of stage(s) {', '.join(orphaned)}, "
        f"which the job no longer has (its stages: {', '.join(sorted(stages))}). "
        "Resume with --allow-non-restored-state to drop that state, or --rename-stage OLD=NEW to move it."
    )


def version_mismatch(job: str, actual: str, expected: str) -> str:
    return (
        f"job {job}: refused to start on Spark {actual}: it was launched for the {expected} version group "
        f"and Spark needs driver and executors at exactly one version. "
        f"Relaunch it on the {expected} group, or resume it from a savepoint on the {actual} group."
    )


class Driver:
    def __init__(self, settings: Settings, job: str, run_id: int, lease_seconds: float | None = None) -> None:
        self.settings = settings
        self.lease_seconds = lease_seconds if lease_seconds is not None else lease.lease_seconds()
        self.url = settings.database_url
        self.job = job
        self.run_id = run_id

    def fail(self, message: str) -> None:
        with session_scope(self.url) as s:
            run = s.get(JobRun, self.run_id)
            if run:
                run.state, run.error, run.ended_at = "FAILED", message, utcnow()
            audit.record(s, "job.fail", "job", self.job, outcome="failed", run=self.run_id, error=message)

    def stop_requested(self) -> bool:
        """True when a savepoint asked for a stop, or this run is no longer the job's current one (fenced)."""
        with session_scope(self.url) as s:
            job = s.get(Job, self.job)
            return job is None or job.desired in STOPPING or job.current_run_id != self.run_id

    def report(self, progress: dict[str, int | None], committed: bool, state: str = "RUNNING") -> None:
        with session_scope(self.url) as s:
            run = s.get(JobRun, self.run_id)
            assert run is not None
            now = utcnow()
            run.heartbeat_at, run.progress = now, dict(progress)
            if run.state in ("SUBMITTED", "RUNNING"):
                run.state = state
            if committed:
                run.last_commit_at = now
                run.first_commit_at = run.first_commit_at or now
            if state != "RUNNING":
                run.ended_at = now
                audit.record(s, "job.stop", "job", self.job, run=self.run_id, state=state, progress=progress)

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

    def run_streaming(
        self,
        stages: list[Stage],
        checkpoint_root: Path,
        trigger_seconds: float,
        allow_non_restored: bool = False,
        spark: Any = None,
    ) -> bool:
        """Run until asked to stop. False when the restored state does not fit the job's stages."""
        names = [stage.name for stage in stages]
        if len(set(names)) != len(names):
            raise ValueError(f"job {self.job}: stage names must be unique, got {names}")
        restored = set(checkpoints.stage_names(checkpoint_root))
        refusal = unmatched_state(self.job, restored, set(names))
        if refusal and not allow_non_restored:
            print(refusal, file=sys.stderr, flush=True)
            self.fail(refusal)
            return False
        for orphan in restored - set(names):  # allowed: set aside, so later savepoints do not carry it
            (checkpoint_root / orphan).rename(checkpoint_root / f".dropped-{orphan}")
        seen = {n: last_commit(checkpoint_root / n) for n in names}
        self.report(seen, committed=False)
        described: set[str] = set()
        took_over = False
        while True:
            queries = [self._start(stage, checkpoint_root / stage.name) for stage in stages]
            try:
                for query in queries:
                    query.awaitTermination()
            except Exception:
                if self.stop_state() != "fenced":
                    raise
                for query in queries:  # a fenced write failed its batch: nothing of it landed
                    query.stop()
            now = {n: last_commit(checkpoint_root / n) for n in names}
            fresh = [n for n in names if n not in described and now[n] is not None]
            if spark is not None and fresh and self.stop_state() != "fenced":
                self.report_operators(spark, checkpoint_root, fresh)
                described.update(fresh)
            advanced = any((now[n] or -1) > (seen[n] if seen[n] is not None else -1) for n in names)
            seen = now
            if not took_over:  # even with no data to write, a successor that ran a cycle has taken over
                took_over = lease.take_over(self.url, self.job, self.run_id)
            if self.stop_state() != "fenced":
                self.report(now, committed=advanced)
            if not self._between_cycles(now, trigger_seconds):
                return True

    def stop_state(self) -> str:
        """"fenced" once another run is the job's current one, else the job's desired state: RUN, STOP or MOVE."""
        with session_scope(self.url) as s:
            job = s.get(Job, self.job)
            if job is None or job.current_run_id != self.run_id:
                return "fenced"
            return job.desired

    def _between_cycles(self, progress: dict[str, int | None], trigger_seconds: float) -> bool:
        """Wait for the next cycle. False when this run ends: fenced off, or handed off after parking."""
        deadline = time.monotonic() + trigger_seconds
        while True:
            state = self.stop_state()
            if state in ("fenced", "STOP"):
                self.report(progress, committed=False, state="STOPPED")
                return False
            if state == "MOVE":
                return self._park(progress)
            if time.monotonic() >= deadline:
                return True
            time.sleep(min(0.25, trigger_seconds))

    def _park(self, progress: dict[str, int | None]) -> bool:
        """Stopped at a batch boundary: wait, holding the lease, until handed off (False) or resumed (True)."""
        lease.park(self.url, self.job, self.run_id, progress, self.lease_seconds)
        log.info("job %s run %s parked at %s for up to %.0f s", self.job, self.run_id, progress, self.lease_seconds)
        while (decision := self._decide()) == "wait":
            time.sleep(0.5)
        log.info("job %s run %s: %s", self.job, self.run_id, decision)
        return decision == "resume"

    def _decide(self) -> lease.Decision:
        """The lease's decision; a registry that does not answer means wait, not fail: the run is parked on a
        clean boundary, and failing would leave it unresumable."""
        try:
            return lease.decide(self.url, self.job, self.run_id)
        except OperationalError as exc:
            log.warning("job %s run %s: the registry did not answer (%s); still parked", self.job, self.run_id, exc)
            return "wait"

    def _start(self, stage: Stage, checkpoint: Path):  # type: ignore[no-untyped-def]
        url, job, name, to_results, run_id = self.url, self.job, stage.name, stage.to_results, self.run_id

        def sink(frame, batch_id: int) -> None:  # type: ignore[no-untyped-def]
            rows = [(str(r[0]), int(r[1])) for r in to_results(frame).collect()]
            write_batch(url, job, name, batch_id, rows, run_id=run_id)

        return (
            stage.frame.writeStream.queryName(name)
            .outputMode(stage.output_mode)
            .option("checkpointLocation", str(checkpoint))
            .foreachBatch(sink)
            .trigger(availableNow=True)
            .start()
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job", required=True)
    parser.add_argument("--run-id", type=int, required=True)
    parser.add_argument("--module", required=True)
    parser.add_argument("--expected-version", required=True)
    parser.add_argument("--checkpoint-root")
    parser.add_argument("--trigger-seconds", type=float, default=1.0)
    parser.add_argument("--allow-non-restored-state", action="store_true")
    parser.add_argument("--lease-seconds", type=float)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("py4j").setLevel(logging.WARNING)

    driver = Driver(Settings.from_env(), args.job, args.run_id, args.lease_seconds)
    spark = SparkSession.builder.appName(f"changeover-{args.job}").getOrCreate()
    try:
        if spark.version != args.expected_version:
            message = version_mismatch(args.job, spark.version, args.expected_version)
            print(message, file=sys.stderr, flush=True)
            driver.fail(message)
            return 3
        with session_scope(driver.url) as s:
            job = s.get(Job, args.job)
            options = dict(job.options) if job else {}
        module = importlib.import_module(args.module)
        context = JobContext(args.job, args.run_id, options, driver.stop_requested)
        if hasattr(module, "build"):
            stages = module.build(spark, context)
            if not driver.run_streaming(stages, Path(args.checkpoint_root), args.trigger_seconds,
                                        args.allow_non_restored_state, spark):
                return 4
        else:
            driver.report({}, committed=False)
            module.run(spark, context)
            driver.report({}, committed=False, state="FINISHED")
        return 0
    except Exception as exc:
        driver.fail(f"job {args.job}: {type(exc).__name__}: {exc}")
        raise
    finally:
        spark.stop()
