"""A platform team's Spark standalone cluster, played on this machine for the tests of `StandaloneCluster`.

Each member's worker runs on a host of its own: a network namespace with its own address on a bridge, and an SSH
server (Debian's openssh-server) through which the cluster file's command templates reach it. The masters, one per
version, run beside the bridge. Every Spark process is started by Spark's own `sbin/spark-daemon.sh` from a
per-host `spark-env.sh`, never by Changeover; the "installed" Sparks and Pythons are links into the checkout's
runtimes (the filesystem is shared, as a shared mount would be). Everything made here is removed by `close`, also
after a failure: processes by the PIDs their PID files and our own children name, then namespaces and links.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
from pathlib import Path

import httpx
import psutil
from changeover.cluster import platform, rest_auth, wait_for
from changeover.cluster.runtimes import find_runtime, java_home
from changeover.settings import Settings

SSHD = Path("/usr/sbin/sshd")
WORKER = "org.apache.spark.deploy.worker.Worker"
MASTER = "org.apache.spark.deploy.master.Master"
JVM_OPTS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"  # as the tests' other JVMs (tests/conftest.py)


def available() -> str | None:
    """Why hosts of our own cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not SSHD.exists():
        return "openssh-server is not installed (`make test` installs it)"
    if not shutil.which("ip"):
        return "iproute2's `ip` is missing"
    return None


class Platform:
    def __init__(self, root: Path, members: list[str], versions: list[str]) -> None:
        self.root, self.members, self.versions = root, members, versions
        self.tag = f"{random.randrange(16**4):04x}"
        # not 169.254.169.0/24, which holds cloud metadata addresses
        self.net = f"169.254.{random.choice([n for n in range(64, 250) if n != 169])}"
        self.bridge = f"chb{self.tag}"
        self.gateway = f"{self.net}.1"
        self.hosts = {m: f"{self.net}.{11 + i}" for i, m in enumerate(members)}
        self.namespaces = {m: f"chg-{self.tag}-{m}" for m in members}
        self.sshd: dict[str, subprocess.Popen[bytes]] = {}
        self.master_ports = {v: (7177 + 10 * i, 8180 + 10 * i, 6166 + 10 * i) for i, v in enumerate(versions)}
        self.rest_key_file = root / "platform" / "rest-key"
        self.cluster_file = root / "platform" / "cluster.json"
        self.shared = root / "shared"  # Changeover's home: storage every host sees

    # -- the hosts -----------------------------------------------------------------------
    def start(self) -> Platform:
        folder = self.root / "platform"
        (folder / "opt").mkdir(parents=True, exist_ok=True)
        for version in self.versions:  # "installed on every host" at the platform's own paths
            runtime = find_runtime(Settings.from_env().runtimes_dir, version)
            (folder / "opt" / f"spark-{version}").symlink_to(runtime.spark_home)
            (folder / "opt" / f"venv-{version}").symlink_to(runtime.root)
        rest_auth.load_or_create_key(self.rest_key_file)
        self._keys(folder)
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for member, address in self.hosts.items():
            namespace, outside = self.namespaces[member], f"chv{self.tag}{self.members.index(member)}"
            _ip("netns", "add", namespace)
            _ip("link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns", namespace)
            _ip("link", "set", outside, "master", self.bridge)
            _ip("link", "set", outside, "up")
            for args in (("addr", "add", f"{address}/24", "dev", "eth0"), ("link", "set", "eth0", "up"),
                         ("link", "set", "lo", "up")):
                _ip("netns", "exec", namespace, "ip", *args)
            self._spark_env(member, address)
            self.start_sshd(member)
        self._write_cluster_file()
        return self

    def start_sshd(self, member: str) -> None:
        folder = self.root / "platform" / "hosts" / member
        config = folder / "sshd_config"
        config.write_text("\n".join([
            f"ListenAddress {self.hosts[member]}", "Port 22", f"HostKey {self.root / 'platform' / 'host_key'}",
            f"PidFile {folder / 'sshd.pid'}", f"AuthorizedKeysFile {self.root / 'platform' / 'id.pub'}",
            "StrictModes no", "PermitRootLogin prohibit-password", "PasswordAuthentication no",
            "KbdInteractiveAuthentication no", "UsePAM no", "PrintMotd no", "LogLevel ERROR", ""]))
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation folder
        with open(folder / "sshd.log", "ab") as log:  # the child keeps its own copy of the descriptor
            self.sshd[member] = subprocess.Popen(
                ["ip", "netns", "exec", self.namespaces[member], str(SSHD), "-D", "-e", "-f", str(config)],
                stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
        wait_for(lambda: self.ssh(member, "true").returncode == 0, 30, f"the SSH server of host {member}")

    def stop_sshd(self, member: str) -> None:
        child = self.sshd.pop(member, None)
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGTERM)
            child.wait(timeout=10)

    def ssh(self, member: str, command: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ssh", "-F", str(self.root / "platform" / "ssh_config"), self.hosts[member], command],
                              capture_output=True, text=True, timeout=timeout)

    # -- Spark, started as the platform starts it -----------------------------------------
    def start_masters(self) -> None:
        properties = self.root / "platform" / "master.properties"
        properties.write_text(rest_auth.master_properties(rest_auth.load_key(self.rest_key_file)))
        properties.chmod(0o600)
        for version, (port, webui, rest) in self.master_ports.items():
            conf = self._conf_dir(f"master-{version}", {
                "SPARK_MASTER_OPTS": f"-Dspark.master.rest.enabled=true -Dspark.master.rest.port={rest} "
                                     "-Dspark.decommission.enabled=true -Dspark.worker.timeout=30",
                "SPARK_LOCAL_IP": self.gateway, "SPARK_MASTER_HOST": self.gateway, "SPARK_MASTER_PORT": str(port),
                "SPARK_MASTER_WEBUI_PORT": str(webui)})
            self._daemon(conf, version, "start", MASTER, "1", "--properties-file", str(properties))
            wait_for(lambda w=webui: httpx.get(f"http://{self.gateway}:{w}/json/", timeout=5).json()["status"]
                     == "ALIVE", 90, f"the platform's {version} master")

    def start_worker(self, member: str, version: str) -> None:
        """As the platform's own tooling would: the cluster file's start line, run here, not by Changeover."""
        line = platform.load(self.cluster_file).command("start_worker", member, version)
        assert line is not None
        said = subprocess.run(shlex.split(line), capture_output=True, text=True, timeout=120)
        assert said.returncode == 0, said.stdout + said.stderr

    def worker_pid(self, member: str) -> int | None:
        pidfile = self.root / "platform" / "hosts" / member / "pids" / f"spark-platform-{WORKER}-1.pid"
        return int(pidfile.read_text()) if pidfile.exists() else None

    def close(self) -> None:
        """Every process this platform started (workers and masters by their PID files, whose drivers and
        executors are their children; our SSH servers), then the namespaces, the bridge and the links."""
        pids = []
        for pidfile in (self.root / "platform").glob("**/pids/*.pid"):
            with contextlib.suppress(OSError, ValueError):
                pids.append(int(pidfile.read_text()))
        ours = [p for p in psutil.process_iter(["pid", "cmdline"])
                if any(str(self.root) in part for part in p.info["cmdline"] or [])]
        for process in [*(_process(pid) for pid in pids), *ours]:
            with contextlib.suppress(psutil.Error):
                if process is None or not any(str(self.root) in part for part in process.cmdline()):
                    continue  # a PID file left by a process long gone: the PID may be someone else's now
                for child in [*process.children(recursive=True), process]:
                    with contextlib.suppress(psutil.Error):
                        child.kill()
        for member in list(self.sshd):
            self.stop_sshd(member)
        for namespace in self.namespaces.values():
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    # -- helpers --------------------------------------------------------------------------
    def _keys(self, folder: Path) -> None:
        for name in ("host_key", "id"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(folder / name)], check=True)
        (folder / "ssh_config").write_text("\n".join([
            f"Host {self.net}.*", "  User root", f"  IdentityFile {folder / 'id'}", "  IdentitiesOnly yes",
            "  StrictHostKeyChecking no", "  UserKnownHostsFile /dev/null", "  BatchMode yes",
            "  ConnectTimeout 5", "  LogLevel ERROR", ""]))

    def _spark_env(self, member: str, address: str) -> None:
        folder = self.root / "platform" / "hosts" / member
        folder.mkdir(parents=True, exist_ok=True)
        self._conf_dir(f"hosts/{member}", {
            "SPARK_LOCAL_IP": address, "SPARK_WORKER_WEBUI_PORT": "8081", "SPARK_WORKER_CORES": "4",
            "SPARK_WORKER_MEMORY": "4g", "SPARK_WORKER_DIR": str(folder / "work"),
            "SPARK_WORKER_OPTS": "-Dspark.decommission.enabled=true -Dspark.worker.timeout=30"})

    def _conf_dir(self, name: str, values: dict[str, str]) -> Path:
        folder = self.root / "platform" / name
        (folder / "conf").mkdir(parents=True, exist_ok=True)
        values = {"JAVA_HOME": str(java_home()), "SPARK_PID_DIR": str(folder / "pids"),
                  "SPARK_LOG_DIR": str(folder / "logs"), "SPARK_IDENT_STRING": "platform",
                  "SPARK_DAEMON_JAVA_OPTS": JVM_OPTS, "JAVA_TOOL_OPTIONS": JVM_OPTS, **values}
        (folder / "conf" / "spark-env.sh").write_text("".join(f'export {k}="{v}"\n' for k, v in values.items()))
        return folder / "conf"

    def _daemon(self, conf: Path, version: str, *args: str) -> None:
        script = self.root / "platform" / "opt" / f"spark-{version}" / "sbin" / "spark-daemon.sh"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SPARK_", "PYSPARK_", "CHANGEOVER_"))}
        env.pop("JAVA_TOOL_OPTIONS", None)
        subprocess.run([str(script), *args], env={**env, "SPARK_CONF_DIR": str(conf)}, check=True,
                       capture_output=True, timeout=60)

    def _write_cluster_file(self) -> None:
        ssh = f"ssh -F {self.root / 'platform' / 'ssh_config'} {{host}}"
        spark = str(self.root / "platform" / "opt" / "spark-{version}")
        conf = str(self.root / "platform" / "hosts" / "{member}" / "conf")
        self.cluster_file.write_text(json.dumps({
            "masters": {v: {"url": f"spark://{self.gateway}:{port}", "rest_url": f"http://{self.gateway}:{rest}",
                            "webui_url": f"http://{self.gateway}:{webui}"}
                        for v, (port, webui, rest) in self.master_ports.items()},
            "members": {m: {"host": h, "worker_ui": f"http://{h}:8081"} for m, h in self.hosts.items()},
            "commands": {
                "start_worker": f"{ssh} env SPARK_CONF_DIR={conf} {{spark_home}}/sbin/spark-daemon.sh start {WORKER} 1 "
                                "{master_url}",
                "stop_worker": f"{ssh} env SPARK_CONF_DIR={conf} {{spark_home}}/sbin/spark-daemon.sh stop {WORKER} 1",
                "check": f"{ssh} true",
                "timeout_seconds": 60,
            },
            "spark_home": spark,
            "python": str(self.root / "platform" / "opt" / "venv-{version}" / "bin" / "python"),
        }, indent=2))

    def settings(self, database_url: str) -> Settings:
        return Settings.from_env(home=self.shared / "home", database_url=database_url,
                                 rest_key_file=self.rest_key_file, cluster_file=self.cluster_file)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None
