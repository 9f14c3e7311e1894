"""What one drain poll costs as the fleet grows: the real registry and the real drain code, simulated masters.

A rolling upgrade's trigger polls `roll.observe` every 2 s while a member drains. This drains one member of
a simulated fleet (`bench/simulated_fleet.py` over the test double `tests/fake_fleet.py`: masters answer from
memory and count calls) and reports the
median time of one poll and the master calls it makes, for each fleet size, beside the baseline of the same
run: observing every job of the fleet once (what a poll cost before it asked only about the member's jobs).

    .venv/bin/python bench/fleet_scale.py [--fleets 10:100 100:1000] [--polls 20] [--database-url URL]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from changeover import jobs  # noqa: E402
from changeover.registry.db import forget_engines, session_scope  # noqa: E402
from changeover.registry.models import Member, UpgradeRun, utcnow  # noqa: E402
from changeover.registry.schema import migrate  # noqa: E402
from changeover.settings import Settings  # noqa: E402
from changeover.upgrade import lock, roll  # noqa: E402
from simulated_fleet import VERSION, SimulatedFleet  # noqa: E402
from sqlalchemy import create_engine, select, text  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402


def _registry(base: str | None, folder: Path, label: str) -> str:
    if base is None:
        return f"sqlite:///{folder / f'{label}.db'}"
    name = f"changeover_fleet_{label}_{int(time.time())}"
    with create_engine(base, isolation_level="AUTOCOMMIT").connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    return make_url(base).set(database=name).render_as_string(hide_password=False)


def _draining(settings: Settings, fleet: SimulatedFleet, member: str) -> str:
    """An upgrade whose roll is draining `member`, as the trigger finds it between two steps."""
    key = "fleet-bench"
    lock.begin(settings, key, "4.3.0", dict.fromkeys(fleet.hosts, VERSION))
    roll.start(settings, key, list(fleet.hosts))
    with session_scope(settings.database_url) as s:
        run = s.scalar(select(UpgradeRun).where(UpgradeRun.key == key))
        run.progress = {**run.progress, "phases": {**run.progress["phases"], member: roll.DRAINING}}
        row = s.get(Member, member)
        row.status, row.drain_started_at = "DRAINING", utcnow()
    fleet.decommission(member)
    return key


def _timed(action, polls: int) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """Median seconds of one call, and master calls per call."""
    times, calls = [], []
    for _ in range(polls):
        before = sum(action.fleet.master_.calls.values())
        began = time.perf_counter()
        action()
        times.append(time.perf_counter() - began)
        calls.append(sum(action.fleet.master_.calls.values()) - before)
    return statistics.median(times), statistics.mean(calls)


class _Poll:
    def __init__(self, settings: Settings, fleet: SimulatedFleet, key: str) -> None:
        self.settings, self.fleet, self.key = settings, fleet, key

    def __call__(self) -> None:
        status = roll.observe(self.settings, self.fleet, self.key)  # type: ignore[arg-type]
        assert status.current is not None and status.drain is not None


class _EveryJob(_Poll):
    def __call__(self) -> None:
        jobs.refresh_all(self.settings, self.fleet)  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fleets", nargs="+", default=["10:100", "100:1000"], help="MEMBERS:JOBS")
    parser.add_argument("--polls", type=int, default=20)
    parser.add_argument("--database-url", help="a PostgreSQL server to create scratch registries on")
    args = parser.parse_args()
    print("| members | jobs | jobs on the member | poll (median) | master calls / poll | every job observed once "
          "(baseline) | its calls | poll / baseline |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for spec in args.fleets:
            members, count = (int(x) for x in spec.split(":"))
            url = _registry(args.database_url, Path(folder), f"{members}x{count}")
            migrate(url)
            settings = Settings.from_env(home=Path(folder) / f"home-{members}", database_url=url)
            fleet = SimulatedFleet(settings, members, count)
            member = next(iter(fleet.hosts))
            key = _draining(settings, fleet, member)
            on_member = sum(1 for driver in fleet.master_.drivers.values() if driver.host == fleet.hosts[member])
            poll, poll_calls = _timed(_Poll(settings, fleet, key), args.polls)
            every, every_calls = _timed(_EveryJob(settings, fleet, key), max(3, args.polls // 5))
            print(f"| {members} | {count} | {on_member} | {poll * 1000:.1f} ms | {poll_calls:.0f} | "
                  f"{every * 1000:.0f} ms | {every_calls:.0f} | {poll / every:.1%} |")
            forget_engines()


if __name__ == "__main__":
    main()
