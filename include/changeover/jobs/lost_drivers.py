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
from changeover.registry.db import session_scope
from changeover.registry.models import Event, JobRun, utcnow
from changeover.runtime.sinks import KINDS
from changeover.settings import Settings
from changeover.timeutil import as_utc

log = logging.getLogger(__name__)

# How the control plane words a death it inferred, not one the driver's own master saw happen.
INFERRED = ("its master reports ERROR", "lost: ")
STOP_SECONDS = 10.0  # for a self-fencing driver to stop its queries once it has decided to


def await_stopped(settings: Settings, lost: JobRun) -> None:
    """Return once the lost run's driver has stopped writing to its unfenced sinks: it said so (the `job.stop` it
    records when it finds itself fenced), or its silence outlasts the bound after which it fences itself. Fenced
    sinks need no wait: the fence, or the sink's own epoch, refuses its writes."""
    unfenced = sorted(stage for stage, sink in (lost.sinks or {}).items()
                      if not KINDS.get(str(sink.get("kind")), KINDS["files"]).fenced)
    if not unfenced or not (lost.error or "").startswith(INFERRED):
        return
    bound = lease.self_fence_seconds() + lease.HEARTBEAT_SECONDS + STOP_SECONDS
    began = utcnow()

    def stopped() -> str | None:
        with session_scope(settings.database_url) as s:
            said = s.scalars(select(Event.details).where(Event.action == "job.stop", Event.subject == lost.job))
            if any(details.get("run") == lost.id for details in said):
                return "it stopped its queries when it found itself fenced"
            run = s.get(JobRun, lost.id)
            assert run is not None
            silent = (utcnow() - as_utc(run.heartbeat_at or run.submitted_at)).total_seconds()
            return f"silent for {silent:.0f} s, past its self-fence bound" if silent > bound else None

    wait_for(lambda: stopped() is not None, bound + 30, f"the driver of run {lost.id} of job {lost.job}, declared "
             f"lost, to stop its {', '.join(unfenced)} stage(s)", interval=0.5, retryable=())
    how = stopped()
    log.info("job %s run %s: %s", lost.job, lost.id, how)
    with session_scope(settings.database_url) as s:
        audit.record(s, "job.lost_driver_stopped", "job", lost.job, run=lost.id, stages=unfenced, how=how,
                     waited_seconds=round((utcnow() - began).total_seconds(), 1))
