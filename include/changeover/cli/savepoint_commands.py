"""`changeover savepoint`, `savepoints` and `retention`: take, delete, list and age out savepoints."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Annotated

import typer

from changeover.cli.app import JsonFlag, app, checked_settings, emit, out
from changeover.errors import ChangeoverError


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
        savepoints.delete(checked_settings(), words[1], words[2])
        out().print(f"savepoint {words[2]} of job {words[1]} deleted")
        return
    if len(words) != 2:
        raise ChangeoverError(f"savepoint {' '.join(words)!r}", "it takes JOB NAME, or delete JOB NAME",
                              "see `changeover savepoint --help`")
    job, name = words
    check_name("savepoint", name)
    settings = checked_settings()
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
    out().print(f"savepoint {sp.name} of job {job} ({sp.mode}): {sp.size_bytes:,} bytes at batches {sp.stages}")


@app.command("savepoints")
def list_savepoints(job: Annotated[str | None, typer.Option(help="Only this job's savepoints.")] = None,
                    as_json: JsonFlag = False) -> None:
    """TIME, SIZE (bytes), JOB NAME, SAVEPOINT NAME (the columns of Jet's list-snapshots), then Spark version
    and mode."""
    from changeover import savepoints

    emit(savepoints.list_savepoints(checked_settings(), job), as_json,
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
    deleted = savepoints.apply_retention(checked_settings(), job, max_count, age)
    out().print(f"deleted: {', '.join(deleted) or 'nothing'}")
