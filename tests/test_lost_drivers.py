"""When a successor's launch may copy a lost run's checkpoint (`jobs.lost_drivers.await_stopped`), on the registries:
at once when the death was seen by the driver's master or the run's sinks are all fenced; after the old driver's
own word that it stopped, or after its silence outlasts its self-fence bound, when its death was only inferred and
a sink nothing fences could still take its writes."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
from changeover import audit
from changeover.jobs import lost_drivers
from changeover.registry.db import session_scope
from changeover.registry.models import Job, JobRun, utcnow
from changeover.settings import Settings

FILES = {"events": {"kind": "files", "path": "/data/events"}}
KEYED = {"totals": {"kind": "keyed_table", "table": "totals"}}
WORKER_LOST = "its master reports ERROR: its worker was lost, or the driver could not be started"


def _lost_run(settings: Settings, sinks: dict[str, dict[str, str]], error: str, silent: float) -> JobRun:
    with session_scope(settings.database_url) as s:
        s.add(Job(name="clicks", module="jobs.clicks", fault_tolerant=True, block_shutdown=False, options={},
                  desired="RUN"))
        s.flush()
        run = JobRun(job="clicks", spark_version="4.2.0", master_url="spark://x", state="KILLED", progress={},
                     sinks=sinks, error=error, heartbeat_at=utcnow() - timedelta(seconds=silent), ended_at=utcnow())
        s.add(run)
        s.flush()
        s.get(Job, "clicks").make_current(run)
        return run


def _waits(settings: Settings) -> list[dict[str, Any]]:
    return [e.details for e in audit.find(settings.database_url, job="clicks") if e.action == "job.lost_driver_stopped"]


@pytest.mark.parametrize(("sinks", "error"), [
    (KEYED, WORKER_LOST),  # its writes are refused by the fence, or by the sink's own epoch
    (FILES, "its driver ended without reporting a failure of its own: killed, or its process crashed"),
])
def test_no_wait_when_nothing_unfenced_could_take_a_live_driver_s_writes(settings: Settings, sinks: dict[str, dict[
        str, str]], error: str) -> None:
    lost_drivers.await_stopped(settings, _lost_run(settings, sinks, error, silent=1))
    assert _waits(settings) == []


def test_an_inferred_death_waits_for_the_driver_s_own_stop(settings: Settings,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHANGEOVER_LOST_AFTER_SECONDS", "600")  # its silence alone would not do for minutes
    lost = _lost_run(settings, FILES, WORKER_LOST, silent=1)
    with session_scope(settings.database_url) as s:  # what a fenced driver records as it stops its queries
        audit.record(s, "job.stop", "job", "clicks", run=lost.id, state="STOPPED", progress={})
    lost_drivers.await_stopped(settings, lost)
    assert [wait["how"] for wait in _waits(settings)] == ["it stopped its queries when it found itself fenced"]


def test_an_inferred_death_of_a_silent_driver_waits_out_its_self_fence_bound(settings: Settings,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHANGEOVER_LOST_AFTER_SECONDS", "20")  # self-fence after 10 s: the bound is 10 + 5 + 40 s
    lost_drivers.await_stopped(settings, _lost_run(settings, FILES, "lost: no word from its master", silent=52))
    [wait] = _waits(settings)
    assert wait["how"].startswith("silent for 5") and wait["how"].endswith("past its self-fence bound")
    assert 2.0 <= wait["waited_seconds"] < 10.0  # the 3 s it lacked, not more


def test_an_inferred_death_is_waited_for_until_the_driver_says_it_stopped(settings: Settings,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHANGEOVER_LOST_AFTER_SECONDS", "600")
    lost = _lost_run(settings, FILES, WORKER_LOST, silent=1)

    def the_driver_stops() -> None:  # what a fenced driver records once its queries have stopped
        with session_scope(settings.database_url) as s:
            audit.record(s, "job.stop", "job", "clicks", run=lost.id, state="STOPPED", progress={})

    timer = threading.Timer(2.0, the_driver_stops)
    timer.start()
    try:
        lost_drivers.await_stopped(settings, lost)
    finally:
        timer.cancel()
    [wait] = _waits(settings)
    assert wait["how"] == "it stopped its queries when it found itself fenced" and wait["waited_seconds"] >= 1.5
