"""The registry's PostgreSQL restarted mid-upgrade. The server is the test's own (initdb and pg_ctl on a free port),
so stopping it touches nothing else on the machine. While it is away the drivers wait for it (their registry calls
and their sinks' writes retry), the roll's try that meets it fails and its retry goes on, as an Airflow retry would,
and the job ends exact with one move.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from changeover import jobs, roll, upgrades
from changeover.cluster import LocalCluster, wait_for
from changeover.generator import Generator
from changeover.ports import free_port
from changeover.registry.db import TRANSIENT, forget_engines, session_scope
from changeover.registry.models import JobRun, Member
from changeover.registry.schema import migrate
from changeover.settings import Settings
from jobs import clicks
from sqlalchemy import select

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


@dataclass
class Server:
    data: Path
    port: int

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://changeover@127.0.0.1:{self.port}/postgres"

    def ctl(self, *args: str) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-w", "-t", "60", *args)

    def start(self) -> None:
        self.ctl("-l", str(self.data.parent / "server.log"), "-o",
                 f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.data.parent}", "start")

    def stop(self, mode: str = "fast") -> None:
        self.ctl("-m", mode, "stop")

    def pid(self) -> int | None:
        pidfile = self.data / "postmaster.pid"
        return int(pidfile.read_text().split()[0]) if pidfile.exists() else None

    def _run(self, tool: str, *args: str) -> None:
        # PostgreSQL refuses to run as root: as root, run it as the postgres user, as its packages do
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        subprocess.run([*prefix, shutil.which(tool) or tool, *args], check=True, capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    if not (shutil.which("initdb") and shutil.which("pg_ctl")):
        pytest.skip("PostgreSQL's initdb and pg_ctl are needed on the PATH for the registry-restart fault")
    root = Path(tempfile.mkdtemp(prefix="changeover-pg-"))
    if os.geteuid() == 0:
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root, the registry-restart fault needs a postgres user to run PostgreSQL as")
        os.chown(root, owner.pw_uid, owner.pw_gid)
    server = Server(root / "data", free_port())
    try:
        server._run("initdb", "-D", str(server.data), "-U", "changeover", "--auth=trust", "-E", "UTF8")
        server.start()
        yield server
    finally:
        if server.pid() is not None:
            server.stop("immediate")
        shutil.rmtree(root, ignore_errors=True)


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
