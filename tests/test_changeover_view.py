"""The Changeover view the plugin mounts on Airflow's api-server, served here by FastAPI's test client over the real
registry (SQLite and PostgreSQL) and the fake fleet: the overview, an upgrade's timeline from its audit trail and
its runs' checkpoint commit files, the JSON beside them, and the master link. The connection is Airflow's own,
read from AIRFLOW_CONN_CHANGEOVER_DEFAULT as on the api-server. The browser sees the same pages in tests/e2e."""

from __future__ import annotations

import contextvars
import json
import os
from datetime import timedelta
from pathlib import Path

import pytest
from changeover import audit
from changeover.registry.db import session_scope
from changeover.registry.models import Job, JobRun, Master, UpgradeRun, utcnow
from changeover.settings import Settings
from changeover_airflow.view import create_app
from fake_fleet import FakeFleet
from fastapi.testclient import TestClient
from sqlalchemy import select

KEY = "rolling_upgrade/manual__2026-11-27T10:00:00+00:00"


@pytest.fixture
def client(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> TestClient:
    monkeypatch.setenv("AIRFLOW_CONN_CHANGEOVER_DEFAULT", json.dumps({
        "conn_type": "changeover", "extra": {"home": str(settings.home), "database_url": settings.database_url}}))
    return TestClient(create_app(require_login=False))  # no auth manager here: tests/e2e signs in for real


def _commits(root: Path, stage: str, times: list) -> None:
    folder = root / stage / "commits"
    folder.mkdir(parents=True)
    for batch, at in enumerate(times):
        (folder / str(batch)).write_text("v1")
        os.utime(folder / str(batch), (at.timestamp(), at.timestamp()))


def _an_upgrade_with_one_move(settings: Settings, tmp_path: Path) -> None:
    FakeFleet(settings).up([("m1", "4.2.0"), ("m2", "4.3.0")])
    now = utcnow()
    start, end = now - timedelta(seconds=60), now + timedelta(seconds=60)
    old_root, new_root = tmp_path / "cp" / "old", tmp_path / "cp" / "new"
    _commits(old_root, "totals", [now - timedelta(seconds=s) for s in (50, 40, 30)])
    _commits(new_root, "totals", [now - timedelta(seconds=s) for s in (20, 10)])
    with session_scope(settings.database_url) as s:
        s.add(UpgradeRun(key=KEY, target_version="4.3.0", members={"m1": "4.2.0"}, status="SUCCEEDED",
                         actor="alice", started_at=start, finished_at=end))
        s.add(Job(name="clicks", module="jobs.clicks", code=None, fault_tolerant=True, block_shutdown=False,
                  options={}))
        s.add(JobRun(job="clicks", spark_version="4.2.0", master_url="spark://x", state="STOPPED", progress={},
                     checkpoint_root=str(old_root), submitted_at=start - timedelta(seconds=100),
                     first_commit_at=start - timedelta(seconds=90), last_commit_at=now - timedelta(seconds=30),
                     ended_at=now - timedelta(seconds=25)))
        s.flush()
        s.add(JobRun(job="clicks", spark_version="4.3.0", master_url="spark://y", state="RUNNING", progress={},
                     checkpoint_root=str(new_root), submitted_at=now - timedelta(seconds=28),
                     first_commit_at=now - timedelta(seconds=20), last_commit_at=now - timedelta(seconds=10)))

    def as_the_roll_task() -> None:  # in a context of its own: the actor does not outlive this test
        audit.act_as(audit.Acting("alice via airflow:rolling_upgrade/x/roll#1", KEY))
        with session_scope(settings.database_url) as s:
            for action in ("drain.begin", "drain.complete", "member.upgrade.begin", "member.upgrade"):
                audit.record(s, action, "member", "m1")

    contextvars.copy_context().run(as_the_roll_task)


def test_the_overview_shows_the_fleet_jobs_moves_and_upgrades(settings: Settings, tmp_path: Path,
                                                              client: TestClient) -> None:
    _an_upgrade_with_one_move(settings, tmp_path)
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for shown in ("<td>m1</td>", "<td>4.3.0</td>", "<td>clicks</td>", "4.2.0 -&gt; 4.3.0 cold 10.0 s",
                  f"href='/changeover/upgrades/{KEY}'"):
        assert shown in page.text, shown
    data = client.get("/api/fleet").json()
    assert [m["name"] for m in data["members"]] == ["m1", "m2"]
    assert data["jobs"][0]["moves"] == [{"from": "4.2.0", "to": "4.3.0", "kind": "cold", "downtime": 10.0}]


def test_an_upgrades_timeline_shows_each_members_phases_and_each_jobs_commits_and_move(
        settings: Settings, tmp_path: Path, client: TestClient) -> None:
    _an_upgrade_with_one_move(settings, tmp_path)
    data = client.get(f"/api/upgrades/{KEY}").json()
    assert [(s["lane"], s["label"]) for s in data["spans"]] == [
        ("member m1", "draining"), ("member m1", "drained"), ("member m1", "upgrading")]
    assert len(data["commits"]["clicks"]) == 5  # both runs' commits inside the upgrade's window
    assert [m["label"] for m in data["moves"]] == ["4.2.0 -> 4.3.0 cold, 10.0 s"]
    page = client.get(f"/upgrades/{KEY}").text
    assert "<svg" in page and "<title>draining</title>" in page and page.count("stroke='#334e68'") == 5
    assert "4.2.0 -&gt; 4.3.0 cold, 10.0 s" in page
    missing = client.get("/upgrades/rolling_upgrade/nope")
    assert missing.status_code == 404 and "no such upgrade" in missing.text


def test_the_master_link_leads_to_the_target_groups_spark_ui(settings: Settings, tmp_path: Path,
                                                             client: TestClient) -> None:
    _an_upgrade_with_one_move(settings, tmp_path)
    with session_scope(settings.database_url) as s:
        s.get(Master, "4.3.0").webui_port = 8093  # the target's master, told apart from 4.2.0's
    found = client.get(f"/master-of/{KEY}", follow_redirects=False)
    assert found.status_code == 307 and found.headers["location"] == "http://127.0.0.1:8093"
    unknown = client.get("/master/9.9.9", follow_redirects=False)
    assert unknown.status_code == 404 and "no master of Spark 9.9.9" in unknown.text


def test_every_value_from_the_registry_is_escaped(settings: Settings, tmp_path: Path, client: TestClient) -> None:
    """A job or savepoint name is the user's text: it never becomes markup in the page."""
    _an_upgrade_with_one_move(settings, tmp_path)
    with session_scope(settings.database_url) as s:
        s.scalar(select(UpgradeRun).where(UpgradeRun.key == KEY)).actor = "<script>alert(1)</script>"
    page = client.get("/").text
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
