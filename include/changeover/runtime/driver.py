"""The runtime wrapper that runs inside the Spark driver.

It checks the Spark version it was launched for before anything runs, runs each stage as one long-lived
query, reports heartbeats and committed batches to the registry, and stops at a batch boundary when asked:
a user's stop ends the run, a move parks it until its successor takes over (see `changeover.handoff.lease`).
"""
# This module is the entry point (`main`, run by include/changeover_driver.py). The running loop and the park are in
# `runtime.loop`, a standby's wait and priming in `runtime.standby`, what the driver reports in `runtime.reports`.

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import os
import runpy
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

from changeover.registry.db import patiently
from changeover.runtime.contract import JobContext
from changeover.runtime.loop import Driver, GaveUp
from changeover.settings import Settings

log = logging.getLogger("changeover.driver")

ENTRIES = ("build", "run", "script")


def jvm_lost(exc: BaseException, parent_at_start: int, wait: float = 2.0) -> bool:
    """Whether the driver's JVM is gone under its Python (killed, the OOM killer), rather than the job's own code
    having failed: this process lost the parent that started it. A py4j error is how the loss shows (a reset
    socket surfaces as a bare Py4JError), and the kernel may close the JVM's sockets a moment before it re-parents
    its children, so the parent is looked at again for up to `wait` s. Such a run ends KILLED, and a move goes
    on from its checkpoint, as after any other kill."""
    from py4j.protocol import Py4JError

    if not _caused_by(exc, Py4JError):
        return False  # not a failure to reach the JVM: the job's own (its code's sockets included)
    deadline = time.monotonic() + wait
    while os.getppid() == parent_at_start:
        if time.monotonic() >= deadline:
            return False  # the JVM is alive: a py4j error it raised is about the job
        time.sleep(0.1)
    return True


def _caused_by(exc: BaseException, kind: type[BaseException]) -> bool:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, kind):
            return True
        seen.add(id(current))
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return False


def version_mismatch(job: str, actual: str, expected: str) -> str:
    return (
        f"job {job}: refused to start on Spark {actual}: it was launched for the {expected} version group "
        f"and Spark needs driver and executors at exactly one version. "
        f"Relaunch it on the {expected} group, or resume it from a savepoint on the {actual} group."
    )


def stop_queries(spark: Any) -> None:
    """Stop what still runs of a failing run's queries (one stage's failure leaves the others running)."""
    try:
        for query in spark.streams.active:
            query.stop()
    except Exception as exc:  # noqa: BLE001 - a session already gone has nothing running
        log.warning("the queries did not stop cleanly (%s)", exc)


def run_script(module: str) -> None:
    """An unchanged script: run as `python script.py` would, its `__main__` block included."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ImportError(f"job module {module} is not on the driver's path (shipped with --py-files)")
    runpy.run_path(spec.origin, run_name="__main__")


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job", required=True)
    parser.add_argument("--run-id", type=int, required=True)
    parser.add_argument("--module", required=True)
    parser.add_argument("--entry", choices=ENTRIES, default="build")
    parser.add_argument("--expected-version", required=True)
    parser.add_argument("--checkpoint-root")
    parser.add_argument("--allow-non-restored-state", action="store_true")
    parser.add_argument("--standby", action="store_true", help="a warm successor: wait for the checkpoint")
    parser.add_argument("--lease-seconds", type=float)
    parser.add_argument("--stop-deadline", type=float, default=60.0)
    parser.add_argument("--self-fence-seconds", type=float)
    parser.add_argument("--state-partitions", type=int, help="repartition restored state to this many first")
    return parser.parse_args(argv)


def _run_stages(driver: Driver, spark: Any, args: argparse.Namespace, context: JobContext) -> int:
    """A job of stages (`build`), a standby's once it is handed the job: 0 once stopped, handed over or dismissed, 4
    when its restored state does not fit its stages."""
    stages = importlib.import_module(args.module).build(spark, context)
    if args.standby:
        handed = driver.await_hand_over(spark, stages)
        if handed is None:
            return 0
        root, plans, started = handed.root, handed.plans, handed.queries
    else:
        root, plans, started = Path(args.checkpoint_root), None, None
        if args.state_partitions is not None:
            driver.rescale(spark, root, args.state_partitions, [stage.name for stage in stages])
    if not driver.run_streaming(stages, root, args.allow_non_restored_state, spark, plans, started):
        return 4
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("py4j").setLevel(logging.WARNING)
    from pyspark.sql import SparkSession

    parent = os.getppid()  # the driver JVM that runs this Python
    driver = Driver(Settings.from_env(), args.job, args.run_id, args.lease_seconds, args.stop_deadline,
                    args.self_fence_seconds)
    patiently(partial(driver.record_submission, Path.cwd()), driver.registry)
    spark = SparkSession.builder.appName(f"changeover-{args.job}").getOrCreate()
    # alive from the session's start: a parked predecessor then waits for this run to start
    if not patiently(driver.heartbeat, driver.registry):
        log.warning("job %s run %s ended before its driver started; nothing to run", args.job, args.run_id)
        spark.stop()
        return 0
    try:
        if spark.version != args.expected_version:
            message = version_mismatch(args.job, spark.version, args.expected_version)
            print(message, file=sys.stderr, flush=True)
            driver.fail(message)
            return 3
        options = patiently(driver.options, driver.registry)
        context = JobContext(args.job, args.run_id, options)
        if args.entry == "build":
            return _run_stages(driver, spark, args, context)
        driver.report({}, committed=False)
        if args.entry == "run":
            importlib.import_module(args.module).run(spark, context)
        else:
            run_script(args.module)
        driver.report({}, committed=False, state="FINISHED")
        return 0
    except GaveUp:
        return 5  # its reason is beside its checkpoint; recording a failure would leave the job down
    except Exception as exc:
        if jvm_lost(exc, parent):
            driver.lost_jvm(f"its driver's JVM ended under its Python ({type(exc).__name__}: {exc}): killed, or it "
                            "crashed; the checkpoint is whole as of the last commit")
            return 137
        driver.stand_down_queries()  # a write waiting for a hand-over gives up, so the queries can stop
        stop_queries(spark)  # before the failure is on record: a parked run may resume on it, and write the same sinks
        driver.fail(f"job {args.job}: {type(exc).__name__}: {exc}")
        raise
    finally:
        try:
            spark.stop()
        except Exception as exc:  # noqa: BLE001 - with its JVM gone, stopping the session fails too
            log.warning("job %s run %s: the Spark session did not stop cleanly (%s)", args.job, args.run_id, exc)
