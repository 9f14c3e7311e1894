"""Rolling a Spark standalone cluster that Changeover did not start (`StandaloneCluster`), on hosts of its own: each
member's worker in a network namespace with an SSH server, started by Spark's own sbin scripts from the platform's
configuration (tests/platform_hosts.py). Changeover reaches the members only through the cluster file's `ssh` lines
and the masters' JSON and REST APIs. The same roll triggered through Airflow's scheduler, with the `connection` Param
choosing the platform's connection, is tests/e2e's (`test_a_platforms_own_cluster_rolls_through_the_scheduler_one_
move_a_job_exact`, under `make test-e2e`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from changeover import jobs
from changeover.cluster import membership_for, wait_for
from changeover.cluster.standalone import StandaloneCluster
from changeover.errors import ChangeoverError
from changeover.jobs import move_history
from changeover.registry.db import session_scope
from changeover.registry.models import Member
from changeover.registry.schema import migrate
from changeover.settings import Settings
from changeover.upgrade import lock, recovery, roll, verify
from conftest import start_clicks
from jobs import clicks
from platform_hosts import Platform, available
from sqlalchemy import select

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]
MEMBERS = ["h1", "h2", "h3"]
CHANGEOVER = Path(sys.executable).parent / "changeover"


def _changeover(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI as a platform engineer runs it: the cluster file, the registry and the masters' key by environment."""
    env = {**os.environ, **settings.as_env(), "COLUMNS": "200"}
    env.pop("CHANGEOVER_DATABASE_URL", None)
    return subprocess.run([str(CHANGEOVER), *args], env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    why = available()
    if why:
        pytest.skip(why)
    hosts = Platform(tmp_path_factory.mktemp("platform"), MEMBERS, ["4.2.0", "4.3.0"])
    try:
        hosts.start()
        hosts.start_masters()
        for member in MEMBERS:
            hosts.start_worker(member, "4.2.0")
        yield hosts
    finally:
        hosts.close()


@pytest.fixture(scope="module")
def settings(platform: Platform) -> Settings:
    url = f"sqlite:///{platform.shared / 'registry.db'}"
    migrate(url)
    return platform.settings(url)


def test_changeover_adopts_the_platforms_cluster_as_it_runs(platform: Platform, settings: Settings) -> None:
    cluster = membership_for(settings)
    assert isinstance(cluster, StandaloneCluster)  # chosen by the settings' cluster file
    pids = {m: platform.worker_pid(m) for m in MEMBERS}
    cluster.up([(m, "4.2.0") for m in MEMBERS])
    assert {m: platform.worker_pid(m) for m in MEMBERS} == pids  # adopted as they run: nothing restarted
    status = cluster.status()
    assert {(m["name"], m["version"], m["status"], m["host"], m["running"]) for m in status["members"]} == {
        (m, "4.2.0", "ACTIVE", platform.hosts[m], True) for m in MEMBERS}
    with pytest.raises(ChangeoverError, match=r"(?s)cluster down.*Changeover did not start this standalone cluster"):
        cluster.down()


def test_a_member_whose_host_does_not_answer_is_refused_before_anything_drains(
    platform: Platform, settings: Settings
) -> None:
    cluster = membership_for(settings)
    platform.stop_sshd("h3")
    try:
        with pytest.raises(ChangeoverError, match=rf"(?s)check of member h3.*host {platform.hosts['h3']} did not "
                                                  r"answer over ssh.*leave this member out of the upgrade's members"):
            verify.preflight(settings, cluster, "4.3.0", MEMBERS, "platform/refused")
    finally:
        platform.start_sshd("h3")
    assert lock.status(settings, "platform/refused") is None  # no upgrade began
    with session_scope(settings.database_url) as s:
        assert {m.status for m in s.scalars(select(Member))} == {"ACTIVE"}


@pytest.mark.long  # 80-130 s; make test keeps a host that does not answer refused before anything drains (above), and
# an abort that fails where it cannot reach, then succeeds (tests/faults/test_control_plane.py)
def test_a_host_lost_mid_upgrade_stops_the_roll_and_an_abort_brings_back_what_it_can_reach(
    platform: Platform, settings: Settings
) -> None:
    """The second member's SSH server stops after the preflight checked it: the roll stops on its restart, naming
    the host; `changeover upgrade abort` then brings every member it can reach back into service and fails naming
    the one it cannot; with the host back, it ends the upgrade ABORTED, and the job, which never left its member,
    is exact."""
    cluster = membership_for(settings)
    generator = start_clicks(settings, cluster, "clicks_fault")
    try:
        first = jobs.refresh(settings, cluster, "clicks_fault")
        assert first is not None and first.member in MEMBERS
        # the dry run's plan for this cluster: the members in order, the job's member last, the job's one move
        dry = verify.preflight(settings, cluster, "4.3.0", MEMBERS, "platform/lost", dry_run=True).describe()
        assert dry[0].startswith("target Spark 4.3.0; members in order: ") and dry[0].endswith(first.member), dry
        assert f"  job clicks_fault: RUNNING on {first.member} at 4.2.0" in dry, dry
        assert lock.status(settings, "platform/lost") is None  # a dry run begins nothing
        plan = verify.preflight(settings, cluster, "4.3.0", MEMBERS, "platform/lost")
        assert plan.members[-1] == first.member  # members without jobs drain first
        lost = plan.members[1]
        platform.stop_sshd(lost)
        try:
            with pytest.raises(ChangeoverError, match=rf"(?s)stop_worker of member {lost}.*host "
                                                      rf"{platform.hosts[lost]} did not answer over ssh"):
                wait_for(lambda: roll.step(settings, cluster, "platform/lost", 30).done, 600, "the roll",
                         interval=2.0, retryable=())
            lock.release(settings, "platform/lost", "FAILED", "its roll task failed")  # as the finish task does
            refused = _changeover(settings, "upgrade", "abort", "platform/lost", "--reason", "lost host")
            said = " ".join((refused.stdout + refused.stderr).split())
            assert refused.returncode != 0 and re.search(rf"abort of upgrade platform/lost: member {lost} is not back "
                                                         r"in service: .*did not answer over ssh", said), said
            reached = {m["name"]: m["status"] for m in recovery.status(settings, "platform/lost")["members"]}
            assert all(status == "ACTIVE" for name, status in reached.items() if name != lost), reached
        finally:
            platform.start_sshd(lost)
        aborted = _changeover(settings, "upgrade", "abort", "platform/lost", "--reason", "host back")
        assert aborted.returncode == 0, aborted.stdout + aborted.stderr
        after = recovery.status(settings, "platform/lost")
        assert after["status"] == "ABORTED" and {m["status"] for m in after["members"]} == {"ACTIVE"}
    finally:
        generator.stop()
    assert move_history.of(settings, "clicks_fault") == []
    wait_for(lambda: clicks.results(settings.database_url, "clicks_fault")[0] == dict(generator.truth), 300,
             "the job catching up with every generated file")
    jobs.cancel(settings, cluster, "clicks_fault", reason="the test is over")


def test_a_whole_roll_restarts_each_member_through_its_host_and_moves_the_job_once_exact(
    platform: Platform, settings: Settings
) -> None:
    """The roll as the roll task steps it (Airflow's own run of it is tests/e2e's, under `make test-e2e`): each member's
    worker stopped and started at 4.3.0 through the templates, registered with the platform's 4.3.0 master; the job,
    on the member drained last, moved once onto that master's group, exact."""
    cluster = membership_for(settings)
    generator = start_clicks(settings, cluster, "clicks_rolled")
    try:
        plan = verify.preflight(settings, cluster, "4.3.0", MEMBERS, "platform/whole")
        wait_for(lambda: roll.step(settings, cluster, "platform/whole", 30).done, 900, "the roll", interval=2.0,
                 retryable=())
        lock.release(settings, "platform/whole", "SUCCEEDED", "the test's roll is done")  # as the finish task does
    finally:
        generator.stop()
    assert {m["name"]: m["version"] for m in cluster.status()["members"]} == dict.fromkeys(MEMBERS, "4.3.0")
    for member in plan.members:
        assert cluster.master("4.3.0").worker_state(platform.hosts[member]) == "ALIVE"
    run = jobs.refresh(settings, cluster, "clicks_rolled")
    assert run is not None and run.state in jobs.LIVE and run.spark_version == "4.3.0"
    assert [(m.from_version, m.to_version) for m in move_history.of(settings, "clicks_rolled")] == [("4.2.0", "4.3.0")]
    wait_for(lambda: clicks.results(settings.database_url, "clicks_rolled")[0] == dict(generator.truth), 300,
             "the job catching up with every generated file")
    windows = clicks.results(settings.database_url, "clicks_rolled")[1]
    assert windows and all(generator.window_truth[k] == v for k, v in windows.items())
    jobs.cancel(settings, cluster, "clicks_rolled", reason="the test is over")
