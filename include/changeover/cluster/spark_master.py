"""A client for one Spark standalone master: its JSON status, REST submissions and decommissioning."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from changeover.cluster import rest_auth
from changeover.errors import ChangeoverError


class MasterUnreachable(ChangeoverError):
    """The master did not answer in time: no news about its drivers, neither alive nor dead."""


class SubmissionRefused(ChangeoverError):
    """The master's REST server refused our signature: a wrong key says nothing about its drivers either."""


@dataclass(frozen=True)
class DriverStatus:
    submission_id: str
    state: str  # SUBMITTED | RUNNING | FINISHED | FAILED | KILLED | ERROR | RELAUNCHING | UNKNOWN
    worker_host: str | None
    server_version: str


@dataclass(frozen=True)
class ActiveDriver:
    submission_id: str
    state: str  # SUBMITTED (queued for cores) | RUNNING | RELAUNCHING
    worker: str | None  # the master's id of the worker it runs on; None while queued


@dataclass(frozen=True)
class ActiveApp:
    app_id: str
    name: str  # spark.app.name: changeover-<job> for a job's driver, changeover-connect-<member> for a Connect server
    state: str


@dataclass(frozen=True)
class Workload:
    """The drivers and applications a master runs or queues, from one look at its JSON status."""
    drivers: tuple[ActiveDriver, ...]
    apps: tuple[ActiveApp, ...]


class SparkMaster:
    def __init__(self, host: str, webui_port: int, rest_port: int, timeout: float = 10.0,
                 rest_key: str | None = None) -> None:
        self.host = host
        self.webui = f"http://{host}:{webui_port}"
        self.rest = f"http://{host}:{rest_port}/v1/submissions"
        self.timeout = timeout
        self.rest_key = rest_key  # signs every REST request (Spark's JWSFilter); None: an open REST server

    def _request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        if url.startswith(self.rest) and self.rest_key:
            kwargs["headers"] = {**kwargs.get("headers", {}),
                                 "Authorization": f"Bearer {rest_auth.signed_token(self.rest_key)}"}
        try:
            response = httpx.request(method, url, timeout=self.timeout, **kwargs)
        except httpx.HTTPError as exc:
            raise MasterUnreachable(
                f"Spark master at {url}", f"it did not answer within {self.timeout:.0f} s ({exc})",
                "check it with `changeover cluster status`; the step is retried",
            ) from None
        if url.startswith(self.rest) and response.status_code in (401, 403):
            raise SubmissionRefused(
                f"request to the Spark master's REST server {self.rest}",
                f"it refused it with HTTP {response.status_code}: submissions must be signed with its key",
                "give Changeover the master's key (`rest_key_file` in the changeover_default connection, or "
                "CHANGEOVER_REST_KEY_FILE)",
            )
        return response

    def state(self) -> dict[str, Any]:
        return self._request("GET", f"{self.webui}/json/").json()

    def alive_workers(self) -> list[dict[str, Any]]:
        return [w for w in self.state()["workers"] if w["state"] == "ALIVE"]

    def worker_state(self, host: str) -> str | None:
        """The newest worker registered from host; older DEAD entries stay listed by the master."""
        workers = [w for w in self.state()["workers"] if w["host"] == host]
        return max(workers, key=lambda w: w["lastheartbeat"])["state"] if workers else None

    def workload(self) -> Workload:
        state = self.state()
        return Workload(
            tuple(ActiveDriver(str(d["id"]), str(d.get("state", "UNKNOWN")),
                               None if d.get("worker") in (None, "None") else str(d["worker"]))
                  for d in state.get("activedrivers", [])),
            tuple(ActiveApp(str(a["id"]), str(a.get("name", "")), str(a.get("state", "UNKNOWN")))
                  for a in state.get("activeapps", [])),
        )

    def server_version(self) -> str:
        return self._request("GET", f"{self.rest}/status/none").json()["serverSparkVersion"]

    def create(self, request: dict[str, Any]) -> str:
        body = self._request("POST", f"{self.rest}/create", json=request).json()
        if not body.get("success"):
            raise ChangeoverError(
                f"driver submission to {self.rest}", body.get("message", "the master refused it"),
                "check the master's log under the cluster folder",
            )
        return str(body["submissionId"])

    def status(self, submission_id: str) -> DriverStatus:
        body = self._request("GET", f"{self.rest}/status/{submission_id}").json()
        host_port = body.get("workerHostPort")
        return DriverStatus(
            submission_id=submission_id,
            state=body.get("driverState", "UNKNOWN"),
            worker_host=host_port.rsplit(":", 1)[0] if host_port else None,
            server_version=body["serverSparkVersion"],
        )

    def kill(self, submission_id: str) -> bool:
        return bool(self._request("POST", f"{self.rest}/kill/{submission_id}").json().get("success"))

    def decommission(self, host: str) -> None:
        response = self._request("POST", f"{self.webui}/workers/kill/", data={"host": host})
        if response.status_code >= 400:
            raise ChangeoverError(
                f"decommission of the worker on {host}",
                f"the master answered HTTP {response.status_code}",
                "the master must run with spark.decommission.enabled=true",
            )
