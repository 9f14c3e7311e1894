"""A drain window closing mid-drain, on a real cluster: the member goes back to ACTIVE with the reason
recorded, and its blocking job keeps running untouched. The clock is fixed: `now` is passed in."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from changeover import audit, jobs
from changeover.cluster import LocalCluster, wait_for
from changeover.registry.db import session_scope
from changeover.registry.models import Member
from changeover.settings import Settings
from changeover.upgrade import maintenance, roll, verify
from changeover.upgrade.windows import DrainWindow
from conftest import ONE_REGISTRY

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("database_url", ONE_REGISTRY, indirect=True)]
WINDOW = DrainWindow.parse("SUN 02:00-04:00")
INSIDE = datetime(2026, 11, 22, 2, 30, tzinfo=UTC)  # a Sunday
CLOSED = datetime(2026, 11, 22, 4, 1, tzinfo=UTC)


def test_a_member_is_left_active_when_the_window_closes_mid_drain(settings: Settings, cluster: LocalCluster) -> None:
    cluster.up([("m1", "4.2.0")])
    jobs.submit(settings, cluster, "jobs.nightly_report", "report", fault_tolerant=False, block_shutdown=True,
                options={"duration_seconds": 600})
    wait_for(lambda: (run := jobs.refresh(settings, cluster, "report")) is not None and run.state == "RUNNING"
             and run.member == "m1", 180, "the blocking job running on m1")
    maintenance.mark(settings, "m1", "kernel patch")
    verify.preflight(settings, cluster, "4.3.0", maintenance.marked(settings), upgrade_key="window-1")

    waiting = roll.step(settings, cluster, "window-1", window=WINDOW, drain_needs_seconds=600, now=INSIDE)
    assert waiting.current == "m1" and waiting.drain is not None and waiting.drain.wait == ["report"]

    closed = roll.step(settings, cluster, "window-1", window=WINDOW, drain_needs_seconds=600, now=CLOSED)
    assert closed.done and closed.phases == {"m1": "SKIPPED"}
    assert closed.reasons["m1"].startswith("outside the drain window SUN 02:00-04:00 UTC")
    with session_scope(settings.database_url) as s:
        member = s.get(Member, "m1")
        assert (member.status, member.version, member.maintenance) == ("ACTIVE", "4.2.0", "kernel patch")
    run = jobs.refresh(settings, cluster, "report")
    assert run is not None and run.state == "RUNNING"  # the blocking job was not touched
    aborted = [e for e in audit.find(settings.database_url, member="m1") if e.action == "drain.abort"]
    assert len(aborted) == 1 and aborted[0].details["reason"] == closed.reasons["m1"]
