"""A run declared lost on inference alone (its worker lost, its master silent) may still have a driver running: a
false death. The successor's launch fences it first (it becomes the job's current run), then waits here before it
copies the lost run's checkpoint: a batch such a driver planned and wrote into a sink nothing fences after the copy
would be planned again by the successor with other offsets, and skipped by that sink's log."""

from __future__ import annotations

import logging

from sqlalchemy import select

from changeover import audit
from changeover.cluster import wait_for
from changeover.handoff import lease
from changeover.registry.db import TRANSIENT, session_scope
from changeover.registry.models import Event, JobRun, utcnow
from changeover.runtime.sinks import KINDS
from changeover.settings import Settings
from changeover.timeutil import as_utc

log = logging.getLogger(__name__)

# How the control plane words a death it inferred, not one the driver's own master saw happen.
INFERRED = ("its master reports ERROR", "lost: ")
# Past its self-fence bound: a registry call failing slowly (about 25 s on PostgreSQL), the retry's pause (up to
# 5 s), the stop itself, and some clock skew between its host and this one.
MARGIN_SECONDS = 40.0


def await_stopped(settings: Settings, lost: JobRun) -> None:
    """Return once the lost run's driver has stopped writing to its unfenced sinks: it said so (the `job.stop` it
    records when it finds itself fenced), or its silence outlasts the bound after which it fences itself. Fenced
    sinks need no wait: the fence, or the sink's own epoch, refuses its writes. Silence is taken for a stop: a
    driver whose Python stalled while its JVM's queries went on committing would defeat it."""
    unfenced = sorted(stage for stage, sink in (lost.sinks or {}).items()
                      if not KINDS.get(str(sink.get("kind")), KINDS["files"]).fenced)
    if not unfenced or not (lost.error or "").startswith(INFERRED):
        return
    bound = lease.self_fence_seconds() + lease.HEARTBEAT_SECONDS + MARGIN_SECONDS
    began = utcnow()
    seen: list[str] = []

    def stopped() -> bool:
        with session_scope(settings.database_url) as s:
            said = s.scalars(select(Event.details).where(Event.action == "job.stop", Event.subject == lost.job))
            if any(details.get("run") == lost.id for details in said):
                seen.append("it stopped its queries when it found itself fenced")
                return True
            run = s.get(JobRun, lost.id)
            assert run is not None
            # measured anew each time: a driver still heartbeating is alive, and is waited for again
            silent = (utcnow() - as_utc(run.heartbeat_at or run.submitted_at)).total_seconds()
            if silent > bound:
                seen.append(f"silent for {silent:.0f} s, past its self-fence bound")
            return silent > bound

    wait_for(stopped, bound + 30, f"the driver of run {lost.id} of job {lost.job}, declared lost, to stop its "
             f"{', '.join(unfenced)} stage(s)", interval=0.5, retryable=TRANSIENT)
    how = seen[-1]
    log.info("job %s run %s: %s", lost.job, lost.id, how)
    with session_scope(settings.database_url) as s:
        audit.record(s, "job.lost_driver_stopped", "job", lost.job, run=lost.id, stages=unfenced, how=how,
                     waited_seconds=round((utcnow() - began).total_seconds(), 1))
