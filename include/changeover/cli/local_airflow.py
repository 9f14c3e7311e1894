"""Run Airflow from this checkout as users run it: AIRFLOW_HOME inside it, examples off, our DAGs and plugins.

`Standalone` starts `airflow standalone` (api-server, scheduler with the LocalExecutor, dag-processor,
triggerer) in its own process group on free loopback ports, and talks to it over the REST API the UI
uses. The core never imports Airflow: it only builds environments and command lines and speaks HTTP.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import psutil

from changeover.cluster import processes, wait_for
from changeover.cluster.ports import free_port
from changeover.errors import ChangeoverError
from changeover.settings import CHECKOUT, Settings
from changeover.timeutil import as_utc

AIRFLOW = Path(sys.executable).parent / "airflow"


def airflow_env(settings: Settings, airflow_home: Path | None = None, sql_conn: str | None = None) -> dict[str, str]:
    home = airflow_home or Path(os.environ.get("AIRFLOW_HOME") or CHECKOUT / ".airflow")
    # the registry by reference only; the cluster file only if these settings name one
    env = {k: v for k, v in os.environ.items() if k not in ("CHANGEOVER_DATABASE_URL", "CHANGEOVER_CLUSTER_FILE")}
    env.update(settings.as_env())
    env.update({
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(CHECKOUT / "dags"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(CHECKOUT / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__PARALLELISM": "4",
        "AIRFLOW__API__HOST": "127.0.0.1",
        "PYTHONPATH": os.pathsep.join([str(CHECKOUT / "plugins"), str(CHECKOUT / "include")]),
        "AIRFLOW_CONN_CHANGEOVER_DEFAULT": json.dumps({
            "conn_type": "changeover",
            "extra": {"home": str(settings.home), "database_url_file": str(settings.write_reference())},
        }),
    })
    if sql_conn:
        env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = sql_conn
    return env


def migrate_airflow(env: dict[str, str]) -> None:
    result = subprocess.run([str(AIRFLOW), "db", "migrate"], env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"airflow db migrate failed:\n{(result.stdout + result.stderr)[-4000:]}")


def dags_test(dag_id: str, conf: dict[str, Any], env: dict[str, str], log: Path) -> int:
    """`airflow dags test`: runs every task and trigger in this process tree, no scheduler needed."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        return subprocess.run(
            [str(AIRFLOW), "dags", "test", dag_id, "-c", json.dumps(conf)], env=env, stdout=out,
            stderr=subprocess.STDOUT,
        ).returncode


FINISHED = ("success", "failed")


@dataclass
class Standalone:
    """`airflow standalone` in the background, in its own process group, driven over its REST API."""

    env: dict[str, str]
    log: Path
    port: int = field(default_factory=free_port)
    started: processes.Started | None = None
    replacements: list[tuple[processes.Started, Path]] = field(default_factory=list)  # restarted components, logs
    token: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def home(self) -> Path:
        return Path(self.env["AIRFLOW_HOME"])

    def start(self, timeout: float = 180) -> Standalone:
        env = dict(self.env)
        env.update({
            "PATH": os.pathsep.join([str(AIRFLOW.parent), env.get("PATH", "")]),  # it starts `airflow ...` children
            "AIRFLOW__API__PORT": str(self.port),
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.url}/execution/",
            "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
            "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "False",
        })
        self.env = env
        self.started = processes.spawn([str(AIRFLOW), "standalone"], env, self.log, cwd=self.home)
        self.wait(self._healthy, timeout, "Airflow's api-server, scheduler, dag-processor and triggerer being healthy")
        return self

    def stop(self) -> bool:
        for replacement, _log in self.replacements:
            processes.stop_group(replacement.pid, replacement.start_ticks, timeout=40)
        self.replacements.clear()
        if self.started is None:
            return False
        stopped = processes.stop_group(self.started.pid, self.started.start_ticks, timeout=40)
        self.started = None
        return stopped

    def __enter__(self) -> Standalone:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what the UI does ---------------------------------------------------------------------
    @property
    def password(self) -> str:
        saved = self.home / "simple_auth_manager_passwords.json.generated"
        return str(json.loads(saved.read_text())["admin"])

    def login(self) -> str:
        reply = httpx.post(f"{self.url}/auth/token", json={"username": "admin", "password": self.password}, timeout=30)
        reply.raise_for_status()
        self.token = str(reply.json()["access_token"])
        return self.token

    def api(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        for fresh in (False, True):  # a restarted api-server may sign tokens with a new key: log in again
            token = self.login() if fresh or self.token is None else self.token
            reply = httpx.request(method, f"{self.url}/api/v2{path}", headers={"Authorization": f"Bearer {token}"},
                                  timeout=30, **kwargs)
            if reply.status_code != 401:
                break
        return reply

    def wait_for_dag(self, dag_id: str, timeout: float = 120) -> None:
        self.wait(lambda: self.api("GET", f"/dags/{dag_id}").status_code == 200, timeout,
                  f"the dag-processor parsing DAG {dag_id}")

    def trigger(self, dag_id: str, conf: dict[str, Any]) -> str:
        """Unpause and trigger the DAG as the UI's Trigger button does. Returns the run id."""
        self.wait_for_dag(dag_id)
        self.api("PATCH", f"/dags/{dag_id}", json={"is_paused": False}).raise_for_status()
        reply = self.api("POST", f"/dags/{dag_id}/dagRuns", json={"logical_date": None, "conf": conf})
        if reply.status_code >= 400:
            raise ChangeoverError(f"run of DAG {dag_id} with {conf}", f"Airflow refused it: {reply.text}",
                                  "fix the parameters as the message says")
        return str(reply.json()["dag_run_id"])

    def run(self, dag_id: str, run_id: str) -> dict[str, Any]:
        reply = self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}")
        reply.raise_for_status()
        return dict(reply.json())

    def task_instances(self, dag_id: str, run_id: str) -> list[dict[str, Any]]:
        reply = self.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances")
        reply.raise_for_status()
        return list(reply.json()["task_instances"])

    def await_question(self, dag_id: str, run_id: str, task_id: str, timeout: float = 600) -> None:
        """Wait until a human-in-the-loop task asks for its answer (the UI's Required Actions then list it)."""
        self.wait(lambda: any(ti["task_id"] == task_id and ti["state"] in ("awaiting_input", "deferred")
                              for ti in self.task_instances(dag_id, run_id)), timeout,
                  f"task {task_id} of run {run_id} asking for an answer")

    def follow(self, dag_id: str, run_id: str, timeout: float, on_change: Any = None, on_poll: Any = None) -> str:
        """Wait until the run ends; report each task's state change (and call `on_poll` at every look). Returns the
        run's final state."""
        deadline, seen = time.monotonic() + timeout, {}
        while time.monotonic() < deadline:
            if on_poll is not None:
                on_poll()
            for ti in self.task_instances(dag_id, run_id):
                now = (ti["state"], ti["try_number"])
                if seen.get(ti["task_id"]) != now and on_change is not None:
                    on_change(ti)
                seen[ti["task_id"]] = now
            state = str(self.run(dag_id, run_id)["state"])
            if state in FINISHED:
                return state
            time.sleep(2)
        raise ChangeoverError(f"run {run_id} of DAG {dag_id}", f"it did not finish within {timeout:.0f} s",
                              f"look at the grid at {self.url}/dags/{dag_id} and the logs under {self.home}/logs")

    @property
    def logs(self) -> list[Path]:
        """Standalone's log, then each restarted component's."""
        return [self.log, *(log for _started, log in self.replacements)]

    def kill_component(self, name: str) -> list[int]:
        """SIGKILL one of standalone's components (e.g. the scheduler) and every process under it (its executor's
        workers, its log server), as a crash under a service manager that ends the service's whole group would.
        Returns the PIDs."""
        assert self.started is not None
        killed = []
        for pid in processes.group_members(self.started.pid):
            cmdline = processes.cmdline(pid)
            if pid != self.started.pid and cmdline[1:3] == [str(AIRFLOW), name]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    component = psutil.Process(pid)
                    tree = [component, *component.children(recursive=True)]
                    for process in tree:  # all found before any dies: an orphan leaves the tree
                        with contextlib.suppress(psutil.NoSuchProcess):
                            process.kill()
                            killed.append(process.pid)
        return killed

    def restart_component(self, name: str, timeout: float = 180) -> None:
        """Start one component again on its own, as a service manager restarts a crashed one; standalone's other
        components run on. Returns once the new one heartbeats; it is stopped with the rest."""
        assert self.started is not None
        since = datetime.now(UTC)
        log = self.log.with_name(f"{self.log.stem}-{name}.log")
        started = processes.spawn([str(AIRFLOW), name], self.env, log, cwd=self.home)
        self.replacements.append((started, log))
        component = name.replace("-", "_")

        def heartbeating() -> bool:
            if not processes.is_running(started.pid, started.start_ticks):
                raise ChangeoverError(f"restart of Airflow's {name}", "it exited while starting",
                                      f"read its log: {log}")
            health = self._health().get(component, {})
            beat = health.get(f"latest_{component}_heartbeat")
            if health.get("status") != "healthy" or beat is None:
                return False
            return as_utc(datetime.fromisoformat(beat)) > since  # the killed one's last beat is no news of the new

        self.wait(heartbeating, timeout, f"Airflow's restarted {name} heartbeating")

    def event_logs(self, **filters: Any) -> list[dict[str, Any]]:
        reply = self.api("GET", "/eventLogs", params={"limit": 1000, **filters})
        reply.raise_for_status()
        return list(reply.json()["event_logs"])

    # -- helpers ------------------------------------------------------------------------------
    def _healthy(self) -> bool:
        if self.started is None or not processes.is_ours(self.started.pid, self.started.start_ticks):
            raise ChangeoverError("airflow standalone", "it exited while starting",
                                  f"read its log: {self.log}")
        health = self._health()
        parts = ("metadatabase", "scheduler", "triggerer", "dag_processor")
        return all(health.get(p, {}).get("status") == "healthy" for p in parts)

    def _health(self) -> dict[str, Any]:
        """Airflow's own report of each component: its status and latest heartbeat."""
        return dict(httpx.get(f"{self.url}/api/v2/monitor/health", timeout=5).json())

    @staticmethod
    def wait(condition: Any, timeout: float, what: str) -> None:
        """Like `wait_for`, but a ChangeoverError (Airflow exited while starting) ends the wait at once."""
        wait_for(condition, timeout, what, interval=1,
                 retryable=(httpx.HTTPError, KeyError, ValueError, FileNotFoundError), fix="look at the Airflow logs")
