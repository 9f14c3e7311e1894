"""The local cluster: masters per version group, workers per member, and a clean stop even after a crash."""

from pathlib import Path

import httpx
import pytest
from changeover import jobs
from changeover.cluster import LocalCluster, processes, rest_auth, wait_for
from changeover.cluster.spark_master import SparkMaster, SubmissionRefused
from changeover.errors import ChangeoverError
from changeover.registry.db import session_scope
from changeover.registry.models import Master, Member, utcnow
from changeover.registry.schema import migrate
from changeover.settings import Settings
from changeover.timeutil import as_utc

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_down_finds_and_stops_processes_from_the_state_folder_after_a_crash(
    settings: Settings, cluster: LocalCluster, tmp_path: Path
) -> None:
    cluster.up([("solo", "4.2.0")])
    with session_scope(settings.database_url) as s:
        pids = [(m.pid, m.pid_started) for m in s.query(Member)] + [(m.pid, m.pid_started) for m in s.query(Master)]
    assert len(pids) == 2 and all(processes.is_ours(pid, ticks) for pid, ticks in pids)
    assert cluster.status()["members"][0] | {"host": None} == {
        "name": "solo", "version": "4.2.0", "status": "ACTIVE", "group": "4.2.0", "host": None, "running": True,
        "connect": None}  # it serves no light jobs

    # A crash that lost the registry: a fresh database, the same cluster folder.
    amnesiac = Settings(home=settings.home, database_url=f"sqlite:///{tmp_path / 'lost.db'}",
                        runtimes_dir=settings.runtimes_dir)
    migrate(amnesiac.database_url)
    stopped = LocalCluster(amnesiac).down()
    assert sorted(stopped) == ["master-4.2.0", "worker-solo"]
    assert not any(processes.is_ours(pid, ticks) for pid, ticks in pids)


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_masters_rest_server_refuses_unsigned_and_wrongly_signed_requests(
    settings: Settings, cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    row = cluster.ensure_master("4.2.0")
    rest = f"http://{row.host}:{row.rest_port}/v1/submissions"
    unsigned = httpx.post(f"{rest}/create", json={"action": "CreateSubmissionRequest", "appResource": "file:/x",
                                                  "mainClass": "x", "appArgs": [], "clientSparkVersion": "4.2.0",
                                                  "environmentVariables": {}, "sparkProperties": {}}, timeout=10)
    assert unsigned.status_code == 403, unsigned.text
    assert httpx.get(f"{rest}/status/none", timeout=10).status_code == 403

    forged = SparkMaster(row.host, row.webui_port, row.rest_port, rest_key=rest_auth.load_or_create_key(
        settings.home / "other-key"))
    with pytest.raises(ChangeoverError, match="refused it with HTTP 403: submissions must be signed with its key"):
        forged.server_version()

    assert cluster.master("4.2.0").server_version() == "4.2.0"  # signed with the key the master was given
    assert cluster.master("4.2.0").state()["activedrivers"] == []  # the refused create started nothing

    # A driver the master holds queued (no worker yet) is alive in its word, however long it waits; and an
    # observer signing with the wrong key learns nothing about it, so it records nothing.
    with session_scope(settings.database_url) as s:  # a member in the registry only: routing sends the job here
        s.add(Member(name="ghost", version="4.2.0", host="127.0.9.9", status="ACTIVE"))
    queued = jobs.submit(settings, cluster, "jobs.clicks", "queued", options={"landing": str(settings.home)})
    monkeypatch.setenv("CHANGEOVER_LOST_AFTER_SECONDS", "1")
    wait_for(lambda: cluster.master("4.2.0").status(queued.submission_id or "").state == "SUBMITTED", 30,
             "the driver queued at its master")
    wait_for(lambda: (utcnow() - as_utc(queued.submitted_at)).total_seconds() > 2, 10, "the lost deadline passing")
    assert jobs.observe(settings, cluster, queued.id).state == "SUBMITTED"
    wrong = Settings.from_env(home=settings.home, database_url=settings.database_url,
                              rest_key_file=settings.home / "other-key")
    with pytest.raises(SubmissionRefused):
        jobs.observe(wrong, LocalCluster(wrong), queued.id)
    assert jobs.observe(settings, cluster, queued.id).state == "SUBMITTED"
    jobs.cancel(settings, cluster, "queued", reason="test finished with it")
    assert oct(settings.rest_key_file.stat().st_mode & 0o777) == "0o600"
    assert rest_auth.load_or_create_key(settings.rest_key_file) not in " ".join(
        Path(f"/proc/{row.pid}/cmdline").read_text().split("\0"))  # the key is in no command line
