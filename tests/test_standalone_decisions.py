"""`StandaloneCluster`'s decisions without Spark or hosts: the cluster file's refusals, the command runner's (a host
that does not answer over ssh, a command past its timeout) and a restart refused while another team's driver runs on
the worker. The masters' JSON is a stub here (no Spark); tests/test_existing_cluster.py runs the real platform."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from changeover.cluster import host_commands, platform
from changeover.cluster.standalone import StandaloneCluster
from changeover.errors import ChangeoverError
from changeover.registry.db import session_scope
from changeover.registry.models import Event, Job, JobRun, Member, utcnow
from changeover.settings import Settings
from sqlalchemy import select

GOOD: dict[str, Any] = {
    "masters": {"4.2.0": {"url": "spark://m:7077", "rest_url": "http://m:6066", "webui_url": "http://m:8080"}},
    "members": {"w1": {"host": "10.0.0.11", "worker_ui": "http://10.0.0.11:8081"}},
    "commands": {"start_worker": "ssh {host} start {version} {master_url}", "stop_worker": "ssh {host} stop",
                 "timeout_seconds": 5},
    "spark_home": "/opt/spark-{version}",
    "python": "/opt/spark-{version}/venv/bin/python",
}


def _file(tmp_path: Path, **changes: Any) -> Path:
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({**GOOD, **changes}))
    return path


def test_a_good_file_fills_its_templates(tmp_path: Path) -> None:
    spec = platform.load(_file(tmp_path))
    assert spec.command("start_worker", "w1", "4.2.0") == "ssh 10.0.0.11 start 4.2.0 spark://m:7077"
    assert spec.command("check", "w1", "4.2.0") is None  # no template: nothing to run
    assert spec.masters["4.2.0"].rest_port == 6066 and spec.members["w1"].webui_port == 8081


@pytest.mark.parametrize(("changes", "refusal"), [
    ({"members": {"w1": {"host": "-oProxyCommand=sh", "worker_ui": "http://x:8081"}}},
     r"members\.w1\.host: '-oProxyCommand=sh' is not a host name or address"),
    ({"commands": {"start_worker": "ssh {host} start"}}, r"commands\.stop_worker: it is missing"),
    ({"commands": {**GOOD["commands"], "stop_worker": "ssh {hostname} stop"}},
     r"commands\.stop_worker: it uses hostname, which is not one of"),
    ({"masters": {"4.2.0": {**GOOD["masters"]["4.2.0"], "url": "http://m:7077"}}},
     r"masters\.4\.2\.0\.url: 'http://m:7077' is not a spark:// URL"),
    ({"python": ""}, r"the file\.python: it is missing"),
])
def test_a_bad_file_is_refused_naming_the_field(tmp_path: Path, changes: dict[str, Any], refusal: str) -> None:
    with pytest.raises(ChangeoverError, match=rf"(?s)the cluster file .*{refusal}.*fix the file"):
        platform.load(_file(tmp_path, **changes))


def _script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def test_a_host_that_does_not_answer_is_named_with_what_to_do(tmp_path: Path) -> None:
    ssh = _script(tmp_path, "ssh", 'echo "ssh: connect to host $1 port 22: No route to host" >&2; exit 255')
    with pytest.raises(ChangeoverError, match=r"(?s)stop_worker of member w1: host 10\.0\.0\.11 did not answer over "
                                              r"ssh \(ssh: connect to host 10\.0\.0\.11 port 22: No route to host\)"
                                              r".*leave this member out of the upgrade's members"):
        host_commands.run(f"{ssh} 10.0.0.11 stop", "stop_worker of member w1", "10.0.0.11", timeout=10)


def test_a_command_past_its_timeout_is_ended_with_its_children(tmp_path: Path) -> None:
    marker = tmp_path / "still-running"
    slow = _script(tmp_path, "slow", f"(sleep 3; touch {marker}) & sleep 30")
    began = time.monotonic()
    with pytest.raises(ChangeoverError, match=r"did not finish within 1 s \(host h may not answer\)"):
        host_commands.run(str(slow), "start_worker of member w1", "h", timeout=1)
    assert time.monotonic() - began < 10
    time.sleep(4)  # past the child's own sleep: had it survived the group's end, the marker would be there
    assert not marker.exists()


def test_a_killed_task_ends_the_commands_it_runs(tmp_path: Path) -> None:
    """`on_kill` of every Changeover operator calls `end_all`: a stop hanging on its host ends with the task."""
    marker = tmp_path / "outlived"
    hanging = _script(tmp_path, "hanging", f"(sleep 3; touch {marker}) & sleep 60")
    failed: list[BaseException] = []

    def run() -> None:
        try:
            host_commands.run(str(hanging), "stop_worker of member w1", "h", timeout=120)
        except ChangeoverError as exc:
            failed.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    deadline = time.monotonic() + 10
    while not host_commands.end_all() and time.monotonic() < deadline:  # once the command runs, end it
        time.sleep(0.05)
    worker.join(timeout=10)
    assert not worker.is_alive() and failed and "exited -9" in str(failed[0]), failed
    assert host_commands.end_all() == []  # nothing left running
    time.sleep(4)
    assert not marker.exists()  # its background child went with its group


class _Master:
    def __init__(self, state: dict[str, Any]) -> None:
        self._state = state

    def state(self) -> dict[str, Any]:
        return self._state

    def worker_state(self, host: str) -> str | None:
        return next((w["state"] for w in self._state["workers"] if w["host"] == host), None)


def test_a_restart_is_refused_while_another_teams_driver_runs_on_the_worker(settings: Settings,
                                                                              tmp_path: Path) -> None:
    ran = tmp_path / "stop-ran"
    stop = _script(tmp_path, "stop", f"touch {ran}")
    cluster = StandaloneCluster(settings, platform.load(_file(tmp_path, commands={
        "start_worker": "true", "stop_worker": f"{stop} {{host}}"})))
    master = _Master({
        "workers": [{"id": "worker-1", "host": "10.0.0.11", "state": "DECOMMISSIONED"}],
        "activedrivers": [{"id": "driver-ours", "worker": "worker-1"}, {"id": "driver-theirs", "worker": "worker-1"},
                          {"id": "driver-elsewhere", "worker": "worker-2"}],
    })
    cluster.master = lambda version: master  # type: ignore[method-assign, assignment]
    with session_scope(settings.database_url) as s:
        s.add(Member(name="w1", version="4.2.0", host="10.0.0.11", status="DRAINED"))
        s.add(Job(name="ours", module="m", fault_tolerant=True, block_shutdown=False, desired="RUN"))
        s.flush()
        s.add(JobRun(job="ours", spark_version="4.2.0", master_url="spark://m:7077", state="RUNNING",
                     submission_id="driver-ours",
                     submitted_at=utcnow()))
    with pytest.raises(ChangeoverError, match=r"(?s)stop of member w1's worker: it runs drivers Changeover did not "
                                              r"launch \(driver-theirs\), which a restart would kill"):
        cluster.stop_worker("w1")
    assert not ran.exists()  # refused before the stop command ran
    with session_scope(settings.database_url) as s:
        assert not list(s.scalars(select(Event).where(Event.action == "member.stop")))


def test_a_decommission_template_is_run_instead_of_the_masters_endpoint(settings: Settings, tmp_path: Path) -> None:
    ran = tmp_path / "decommissioned"
    script = _script(tmp_path, "decommission", f'echo "$1" > {ran}')
    cluster = StandaloneCluster(settings, platform.load(_file(tmp_path, commands={
        **GOOD["commands"], "decommission": f"{script} {{host}}"})))
    cluster.master = lambda version: pytest.fail("the master's endpoint was used")  # type: ignore[method-assign, assignment]
    with session_scope(settings.database_url) as s:
        s.add(Member(name="w1", version="4.2.0", host="10.0.0.11", status="DRAINING"))
    cluster.decommission("w1")
    assert ran.read_text().strip() == "10.0.0.11"
    with session_scope(settings.database_url) as s:
        assert [e.subject for e in s.scalars(select(Event).where(Event.action == "member.decommission"))] == ["w1"]


class _RegisteringMaster(_Master):
    """A master that lists the worker once `started` exists: a worker that registers after its daemon started."""

    def __init__(self, started: Path) -> None:
        super().__init__({"workers": []})
        self._started = started

    def server_version(self) -> str:
        return "4.2.0"

    def worker_state(self, host: str) -> str | None:
        return "ALIVE" if self._started.exists() else None


RUNS = "org.apache.spark.deploy.worker.Worker running as process 4242.  Stop it first."


@pytest.mark.parametrize(("said", "registers", "refusal"), [
    (RUNS, True, None),
    (RUNS, False, r"(?s)member w1's worker registering with spark://m:7077.*the start was refused \(.*running as "
                  r"process 4242.*a stale PID file, or a worker of another version"),
    ("JAVA_HOME is not set", True, r"start_worker of member w1: .* exited 1: JAVA_HOME is not set"),
])
def test_a_start_refused_because_the_worker_already_runs_waits_for_it_to_register(
        settings: Settings, tmp_path: Path, said: str, registers: bool, refusal: str | None) -> None:
    """Seen on a loaded CI machine: the platform's worker had started but not yet registered, and the start's refusal
    failed the adoption. A worker that never registers fails naming the refusal; any other failure of the start
    fails at once."""
    started = tmp_path / "registered"
    later = f"(sleep 1; touch {started}) >/dev/null 2>&1 & " if registers else ""
    start = _script(tmp_path, "start", f'{later}echo "{said}"; exit 1')
    cluster = StandaloneCluster(settings, platform.load(_file(tmp_path, commands={
        **GOOD["commands"], "start_worker": f"{start} {{host}}"})), start_timeout=20 if registers else 2)
    cluster.master = lambda version: master  # type: ignore[method-assign, assignment]
    master = _RegisteringMaster(started)
    if refusal is not None:
        with pytest.raises(ChangeoverError, match=refusal):
            cluster.start_worker("w1", "4.2.0")
        with session_scope(settings.database_url) as s:
            assert s.get(Member, "w1").status == "STOPPED"
        return
    cluster.start_worker("w1", "4.2.0")
    assert started.exists()
    with session_scope(settings.database_url) as s:
        assert s.get(Member, "w1").status == "ACTIVE"
        assert [(e.subject, e.details["adopted"]) for e in s.scalars(
            select(Event).where(Event.action == "member.start"))] == [("w1", True)]
