"""A PostgreSQL server of a test's own (initdb and pg_ctl on a free port), so stopping and starting it, to play a
registry restart or outage, touches nothing else on the machine."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from changeover.cluster.ports import free_port


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

    def require_a_password(self) -> None:
        """A rotated secret, as the clients see it: the role now has a password, TCP clients must give it, and the
        connections already open are ended (as a failover would end them). Local socket connections stay trusted, for
        this helper."""
        hba = self.data / "pg_hba.conf"
        (self.data / "pg_hba.conf.trusting").write_text(hba.read_text())
        hba.write_text("local all all trust\nhost all all 127.0.0.1/32 scram-sha-256\n")
        self.sql("ALTER ROLE changeover PASSWORD 'rotated'")
        self.ctl("reload")
        self.sql("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                 "WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()")

    def trust_again(self) -> None:
        (self.data / "pg_hba.conf").write_text((self.data / "pg_hba.conf.trusting").read_text())
        self.ctl("reload")

    def sql(self, statement: str) -> None:
        self._run("psql", "-h", str(self.data.parent), "-p", str(self.port), "-U", "changeover", "-d", "postgres",
                  "-v", "ON_ERROR_STOP=1", "-c", statement)

    def pid(self) -> int | None:
        pidfile = self.data / "postmaster.pid"
        return int(pidfile.read_text().split()[0]) if pidfile.exists() else None

    def _run(self, tool: str, *args: str) -> None:
        # PostgreSQL refuses to run as root: as root, run it as the postgres user, as its packages do
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        subprocess.run([*prefix, shutil.which(tool) or tool, *args], check=True, capture_output=True, timeout=120)


@contextmanager
def own_server() -> Iterator[Server]:
    """A PostgreSQL server of the test's own on a free port, removed after; skips where it cannot be made."""
    if not (shutil.which("initdb") and shutil.which("pg_ctl")):
        pytest.skip("PostgreSQL's initdb and pg_ctl are needed on the PATH for a server of the test's own")
    root = Path(tempfile.mkdtemp(prefix="changeover-pg-"))
    if os.geteuid() == 0:
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root, a server of the test's own needs a postgres user to run PostgreSQL as")
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


