"""The `Membership` protocol a cluster backend implements, and what every backend shares: member lookups and
waiting on a condition."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import httpx
from sqlalchemy import select

from changeover.cluster.spark_master import SparkMaster
from changeover.errors import ChangeoverError
from changeover.registry.db import session_scope
from changeover.registry.models import Master, Member
from changeover.settings import Settings


class NoMaster(ChangeoverError):
    """No master runs for a version group: its drivers and workers went with it."""


class Membership(Protocol):
    """Every verb the control plane, the operators and the CLI use on a cluster; `membership_for` gives one."""

    settings: Settings
    shared_masters: bool  # the masters are a platform's: other teams' work runs there, and they stay up

    def master(self, version: str) -> SparkMaster: ...
    def status(self) -> dict[str, Any]: ...
    def up(self, specs: list[tuple[str, str]], master_port: int | None = None, light_jobs: bool = False) -> None: ...
    def down(self) -> list[str]: ...
    def ensure_master(self, version: str, port: int | None = None) -> Master: ...
    def stop_master_if_empty(self, version: str) -> bool: ...
    def stop_empty_masters(self) -> list[str]: ...
    def start_worker(self, member: str, version: str, light_jobs: bool | None = None) -> None: ...
    def start_connect(self, member: str) -> str: ...
    def stop_connect(self, member: str, grace: float = ...) -> bool: ...
    def connect_running(self, member: str) -> bool: ...
    def remove_member(self, member: str) -> None: ...
    def stop_worker(self, member: str, grace: float = ...) -> None: ...
    def executors_on(self, member: str) -> int: ...
    def decommission(self, member: str) -> None: ...
    def is_decommissioned(self, member: str) -> bool: ...
    def worker_running(self, member: str) -> bool: ...
    def check_reachable(self, member: str) -> None: ...
    def driver_python(self, version: str) -> str: ...


class MasterObservation:
    """What every backend reads the same way: a member's executors from its worker's UI, and whether its group's
    master still places work on it."""

    url: str

    def master(self, version: str) -> SparkMaster:
        raise NotImplementedError

    def executors_on(self, member: str) -> int:
        with session_scope(self.url) as s:
            row = get_member(s, member)
            url = f"http://{row.host}:{row.webui_port}/json/"
        try:
            return len(httpx.get(url, timeout=5).json().get("executors", []))
        except httpx.HTTPError:
            return 0  # the worker is gone, and its executors with it

    def is_decommissioned(self, member: str) -> bool:
        """True once the master no longer places work on the member's worker (or it is gone)."""
        with session_scope(self.url) as s:
            row = get_member(s, member)
            version, host = row.version, row.host
        try:
            return self.master(version).worker_state(host) in (None, "DECOMMISSIONED", "DEAD")
        except NoMaster:
            return True  # no master for its group: nothing can be placed there


def get_member(s: Any, name: str) -> Member:
    """A member's registry row, or a refusal that names the members there are."""
    row = s.get(Member, name)
    if row is None:
        known = ", ".join(s.scalars(select(Member.name).order_by(Member.name))) or "none"
        raise ChangeoverError(f"member {name!r}", f"no such member (known: {known})",
                              "use a name from `changeover cluster status`")
    return row


RETRYABLE: tuple[type[Exception], ...] = (ChangeoverError, httpx.HTTPError, KeyError, ValueError)


def wait_for(
    condition: Callable[[], bool],
    timeout: float,
    what: str,
    interval: float = 0.5,
    retryable: tuple[type[Exception], ...] = RETRYABLE,
    fix: str = "look at the logs under the cluster folder",
) -> None:
    """Poll until the condition holds; errors of the retryable kinds count as "not yet"."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except retryable:
            pass
        time.sleep(interval)
    raise ChangeoverError(what, f"it did not happen within {timeout:.0f} s", fix)


def member_for_host(settings: Settings, host: str | None) -> str | None:
    if host is None:
        return None
    with session_scope(settings.database_url) as s:
        return s.scalar(select(Member.name).where(Member.host == host))
