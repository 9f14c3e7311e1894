"""The local cluster: masters per version group, workers per member, and a clean stop even after a crash."""

from pathlib import Path

import pytest
from changeover import processes
from changeover.cluster import LocalCluster
from changeover.registry.db import session_scope
from changeover.registry.models import Master, Member
from changeover.registry.schema import migrate
from changeover.settings import Settings

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
        "name": "solo", "version": "4.2.0", "status": "ACTIVE", "group": "4.2.0", "host": None, "running": True}

    # A crash that lost the registry: a fresh database, the same cluster folder.
    amnesiac = Settings(home=settings.home, database_url=f"sqlite:///{tmp_path / 'lost.db'}",
                        runtimes_dir=settings.runtimes_dir)
    migrate(amnesiac.database_url)
    stopped = LocalCluster(amnesiac).down()
    assert sorted(stopped) == ["master-4.2.0", "worker-solo"]
    assert not any(processes.is_ours(pid, ticks) for pid, ticks in pids)
