"""Runs in the target runtime's Python: the new code's stages restored from scratch copies of a savepoint.

Each restored stage replays one batch with the offsets the savepoint holds, on a local session, and its
rows go to Spark's `noop` sink instead of the job's own: nothing outside the scratch folder is written.
Run by `changeover.compat.dry_run`.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from changeover.compat.describe_job import build_stages, job_arguments, local_session
from changeover.runtime import state_partitions

MARKER = "CHANGEOVER-DRY-RUN "
POLL_SECONDS = 0.1


def _suppressed(frame: Any, batch_id: int) -> None:
    frame.write.format("noop").mode("overwrite").save()  # runs the whole batch, state included; writes nothing


def _replayed(query: Any, batch: int) -> dict[str, Any] | None:
    done = [p for p in query.recentProgress if p["batchId"] >= batch]
    if not done:
        return None
    return {"batch": done[0]["batchId"], "input_rows": done[0]["numInputRows"],
            "batches": [p["batchId"] for p in query.recentProgress]}


def run(spark: Any, stages: list[Any], checkpoints: Path, replay: dict[str, int], timeout: float,
        rescale: dict[str, int] | None = None) -> dict[str, Any]:
    """Repartition the copies asked for, start the restored stages, wait until each has replayed its batch (or
    failed), stop them all."""
    results: dict[str, Any] = {}
    queries: dict[str, Any] = {}
    wanted = {stage.name: stage for stage in stages if stage.name in replay}
    replay = dict(replay)
    for name, count in (rescale or {}).items():
        try:
            if name in wanted and state_partitions.rescale(spark, checkpoints / name, count) is not None:
                replay[name] += 1  # the planned batch goes after the repartition's own
        except Exception as exc:  # noqa: BLE001 - py4j surfaces Spark's refusal of any kind
            results[name] = {"error": str(exc)}
            wanted.pop(name)
    try:
        for name, stage in wanted.items():
            # once: a restarted query runs the batch its checkpoint has planned and ends; it plans no new batch,
            # so nothing of the live input beyond that batch is read, and no source commits past it
            queries[name] = (stage.frame.writeStream.foreachBatch(_suppressed).queryName(f"dry-run-{name}")
                             .outputMode(stage.output_mode).option("checkpointLocation", str(checkpoints / name))
                             .trigger(once=True).start())
        deadline = time.monotonic() + timeout
        while any(name not in results for name in queries) and time.monotonic() < deadline:
            for name, query in queries.items():
                if name in results:
                    continue
                active = query.isActive  # read first: a query that ended has all its progress recorded
                if (done := _replayed(query, replay[name])) is not None:
                    results[name] = done
                elif not active:
                    error = query.exception()
                    results[name] = {"error": str(error) if error else "the query ended without the batch"}
            time.sleep(POLL_SECONDS)
        for name in queries:
            results.setdefault(name, {"timeout": timeout})
    finally:
        for query in queries.values():
            with contextlib.suppress(Exception):  # a failed query's stop may raise its error again: recorded
                query.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = job_arguments(__doc__)
    parser.add_argument("--checkpoints", required=True, help="scratch folder with one checkpoint per stage")
    parser.add_argument("--replay", required=True, help='JSON {"stage": batch id to replay}')
    parser.add_argument("--timeout", type=float, default=180)
    parser.add_argument("--rescale", default="{}", help='JSON {"stage": state partitions to repartition to first}')
    args = parser.parse_args(argv)
    spark = local_session(f"changeover-dry-run-{args.job}", args.conf, master="local[2]")
    try:
        results = run(spark, build_stages(spark, args), Path(args.checkpoints), json.loads(args.replay),
                      args.timeout, json.loads(args.rescale))
        print(MARKER + json.dumps(results), flush=True)
        return 0
    finally:
        spark.stop()


if __name__ == "__main__":
    sys.exit(main())
