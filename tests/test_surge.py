"""Surge on a real Spark cluster (seed 000's enlarged cluster): with `surge=1` a temporary worker joins at the target
version before the first drain and leaves at the end, so the workers the masters count ALIVE never drop below the
fleet's starting count while each member drains and restarts. The decisions around it (once per upgrade, a retried
step, an abort) are tests/test_roll_decisions.py's, on a fake fleet; here the masters' own JSON is watched."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from changeover.cluster import LocalCluster, wait_for
from changeover.errors import ChangeoverError
from changeover.registry.db import session_scope
from changeover.registry.models import Event, Member
from changeover.registry.schema import migrate
from changeover.settings import Settings
from changeover.upgrade import lock, roll
from sqlalchemy import select

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
KEY = "rolling_upgrade/surge"
VERSIONS = ("4.2.0", "4.3.0")


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[Settings, LocalCluster]]:
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    migrate(url)
    settings = Settings.from_env(home=tmp_path / "home", database_url=url)
    cluster = LocalCluster(settings)
    try:
        cluster.up([("m1", "4.2.0"), ("m2", "4.2.0")])
        yield settings, cluster
    finally:
        cluster.down()
    left = [p.info["pid"] for p in psutil.process_iter(["pid", "cmdline"])
            if any(str(settings.home) in part for part in p.info["cmdline"] or [])]
    assert left == [], f"processes left behind: {left}"


class AliveWorkers:
    """Samples the workers every running master reports ALIVE (a decommissioned or lost worker is not), in a thread,
    until stopped. A sample in which a running master does not answer is left out rather than counted low."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster, self.samples, self.errors = cluster, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> AliveWorkers:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def count(self) -> int | None:
        alive = 0
        for version in VERSIONS:
            try:
                master = self.cluster.master(version)
            except ChangeoverError:  # the registry has no running master of that version: none of its workers
                continue
            try:
                alive += len(master.alive_workers())
            except Exception:  # noqa: BLE001 (a busy or stopping master: this sample says nothing)
                return None
        return alive

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            try:
                seen = self.count()
            except Exception as exc:  # noqa: BLE001 (the test fails on it, instead of the thread ending quietly)
                self.errors.append(repr(exc))
                continue
            if seen is not None:
                self.samples.append(seen)


def test_with_surge_the_masters_never_count_fewer_alive_workers_than_at_the_start(
    fleet: tuple[Settings, LocalCluster]
) -> None:
    settings, cluster = fleet
    starting = AliveWorkers(cluster).count()
    assert starting == 2
    lock.begin(settings, KEY, "4.3.0", dict.fromkeys(("m1", "m2"), "4.2.0"))
    roll.start(settings, KEY, ["m1", "m2"])
    with AliveWorkers(cluster) as watched:
        wait_for(lambda: roll.step(settings, cluster, KEY, 30, surge=1).done, 600, "the roll with surge",
                 interval=1.0, retryable=())
    lock.release(settings, KEY, "SUCCEEDED", "test")

    samples = watched.samples
    assert not watched.errors and len(samples) >= 20, (watched.errors, samples)
    # A drain decommissions its worker through the master first, which stops counting it ALIVE at once, so each
    # member's time out of service shows here however late its process ends.
    assert min(samples) >= starting, samples
    assert {(m["name"], m["version"], m["status"]) for m in cluster.status()["members"]} == {
        ("m1", "4.3.0", "ACTIVE"), ("m2", "4.3.0", "ACTIVE")}  # the surge member is gone from the fleet
    assert len(cluster.master("4.3.0").alive_workers()) == starting
    with session_scope(settings.database_url) as s:
        assert s.get(Member, "surge-1") is None
        order = [(e.action, e.subject, e.details.get("version")) for e in s.scalars(select(Event).where(
            Event.action.in_(("member.start", "member.decommission", "upgrade.surge.remove"))).order_by(Event.id))]
    # the surge worker in service at the target before the first drain, and out of it only after the last upgrade
    assert order == [("member.start", "m1", "4.2.0"), ("member.start", "m2", "4.2.0"),  # the fleet's start
                     ("member.start", "surge-1", "4.3.0"),
                     ("member.decommission", "m1", "4.2.0"), ("member.start", "m1", "4.3.0"),
                     ("member.decommission", "m2", "4.2.0"), ("member.start", "m2", "4.3.0"),
                     ("member.decommission", "surge-1", "4.3.0"), ("upgrade.surge.remove", "surge-1", None)], order
