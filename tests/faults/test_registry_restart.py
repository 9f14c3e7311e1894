"""The registry's PostgreSQL restarted mid-upgrade. The server is the test's own (initdb and pg_ctl on a free port),
so stopping it touches nothing else on the machine. While it is away the drivers wait for it (their registry calls
and their sinks' writes retry), the roll's try that meets it fails and its retry goes on, as an Airflow retry would,
and the job ends exact with one move.
"""

from __future__ import annotations

from collections.abc import Iterator

import psutil
import pytest
from changeover import jobs
from changeover.cli.generator import Generator
from changeover.cluster import LocalCluster, wait_for
from changeover.registry.db import TRANSIENT, forget_engines, session_scope
from changeover.registry.models import JobRun, Member
from changeover.registry.schema import migrate
from changeover.settings import Settings
from changeover.upgrade import roll, upgrades
from jobs import clicks
from pg_server import Server, own_server
from sqlalchemy import select

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with own_server() as started:
        yield started


@pytest.fixture(scope="module")
def live(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Settings, LocalCluster]]:
    migrate(server.url)
    settings = Settings.from_env(home=tmp_path_factory.mktemp("registry-restart") / "home", database_url=server.url)
    cluster = LocalCluster(settings)
    try:
        cluster.up([("r1", "4.2.0"), ("r2", "4.2.0")])
        yield settings, cluster
    finally:
        cluster.down()
        forget_engines()
    home = str(settings.home)
    left = [p.info["pid"] for p in psutil.process_iter(["pid", "cmdline"])
            if any(home in part for part in p.info["cmdline"] or [])]
    assert left == [], f"processes left behind: {left}"


def _drivers_met_the_outage(settings: Settings) -> bool:
    """A driver has logged its wait for the registry (its Python's output lands in the driver folder's stdout)."""
    logs = [*settings.cluster_dir.rglob("stdout"), *settings.cluster_dir.rglob("stderr")]
    return any("the database did not answer" in log.read_text(errors="replace") for log in logs if log.is_file())


def test_the_registry_restarted_mid_move_loses_nothing_and_the_roll_goes_on(
    server: Server, live: tuple[Settings, LocalCluster]
) -> None:
    settings, cluster = live
    generator = Generator(settings.data_dir / "landing")
    generator.write_file()
    generator.start(interval=0.5)
    try:
        jobs.submit(settings, cluster, "jobs.clicks", "restarted",
                    options={"landing": str(generator.landing), "lease_seconds": 60})
        first = jobs.wait_until_committed(settings, cluster, "restarted")
        other = next(m for m in ("r1", "r2") if m != first.member)
        upgrades.begin(settings, "restart/1", "4.3.0", {other: "4.2.0", first.member: "4.2.0"})
        roll.start(settings, "restart/1", [other, first.member])

        def handing_off() -> bool:  # the job parked on its member, its successor launched on 4.3.0
            status = roll.step(settings, cluster, "restart/1", 30)
            return status.current == first.member and status.drain is not None and bool(status.drain.handoff)

        wait_for(handing_off, 600, "the job's successor launched", interval=1.0, retryable=())
        before = server.pid()
        server.stop()  # mid-handoff: the parked run, its successor's start and its first write all need the registry
        try:
            wait_for(lambda: _drivers_met_the_outage(settings), 120, "a driver waiting for the registry")
        finally:
            server.start()
        assert server.pid() != before
        # A roll try that meets the restart fails; its retry goes on from the registry's record, as Airflow's would.
        wait_for(lambda: roll.step(settings, cluster, "restart/1", 30).done, 900, "the roll after the restart",
                 interval=2.0, retryable=TRANSIENT)
        upgrades.release(settings, "restart/1", "SUCCEEDED", "test")
    finally:
        generator.stop()
    wait_for(lambda: clicks.results(settings.database_url, "restarted")[0] == dict(generator.truth), 300,
             "job restarted catching up with every generated file")
    run = jobs.refresh(settings, cluster, "restarted")
    assert run is not None and run.state in jobs.LIVE and run.spark_version == "4.3.0"
    with session_scope(settings.database_url) as s:
        runs = list(s.scalars(select(JobRun).where(JobRun.job == "restarted").order_by(JobRun.id)))
        members = {(m.name, m.version, m.status) for m in s.scalars(select(Member))}
    assert [r.spark_version for r in runs] == ["4.2.0", "4.3.0"]  # one move, no run lost to the restart
    assert members == {("r1", "4.3.0", "ACTIVE"), ("r2", "4.3.0", "ACTIVE")}
    jobs.cancel(settings, cluster, "restarted", reason="test done")
