"""Preflight checks before a rolling upgrade, and the verification after it."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import Any

from sqlalchemy import select

from changeover import audit, jobs
from changeover.cluster import Membership, routing
from changeover.cluster.runtimes import check_version, find_runtime, java_home
from changeover.errors import ChangeoverError
from changeover.jobs import move_history
from changeover.registry.db import session_scope
from changeover.registry.models import Master, Member, Savepoint, UpgradeRun
from changeover.registry.states import Desired, MemberStatus, RunState
from changeover.settings import Settings
from changeover.timeutil import as_utc
from changeover.upgrade import lock, placement, roll, warm

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UpgradePlan:
    target_version: str
    members: list[str]
    old_versions: dict[str, str]
    jobs: list[dict[str, Any]]
    moves: placement.MovePlan

    def describe(self) -> list[str]:
        lines = [f"target Spark {self.target_version}; members in order: {', '.join(self.members) or 'none'}"]
        lines += [f"  {m}: {self.old_versions[m]} -> {self.target_version}" for m in self.members]
        lines += [f"  job {j['name']}: {j['state']} on {j['member']} at {j['version']}" for j in self.jobs]
        return lines + self.moves.describe()


def preflight(
    settings: Settings, cluster: Membership, target: str, requested: list[str], upgrade_key: str,
    dry_run: bool = False,
) -> UpgradePlan:
    check_version(target)
    find_runtime(settings.runtimes_dir, target)
    java_home()
    with session_scope(settings.database_url) as s:
        rows = {m.name: m for m in s.scalars(select(Member).order_by(Member.name))}
        for name in requested:
            if name not in rows:
                raise ChangeoverError(f"member {name!r}", f"no such member (known: {', '.join(rows) or 'none'})",
                                      "use names from `changeover cluster status`, or leave members empty for all")
        chosen = requested or list(rows)
        stopped = [n for n in chosen if rows[n].status == "STOPPED"]
        if stopped:
            raise ChangeoverError(f"members {', '.join(stopped)}", "they are stopped",
                                  "start the cluster with `changeover cluster up` first")
        todo = [n for n in chosen if not (rows[n].version == target and rows[n].status == "ACTIVE")]
        old = {n: rows[n].version for n in todo}
    moves = placement.plan_moves(settings, target, todo)
    moves = replace(moves, cold={job: [warm.planned_cold_reason(settings, job, before, after)
                                       for before, after in pairwise(versions)]
                                 for job, versions in moves.moves.items()})
    todo = moves.order
    # observed before the upgrade begins, so a run found ended now is not counted as ended during it
    live = [job.name for job, run in jobs.refresh_all(settings, cluster, fault_tolerant_only=True)
            if run is not None and run.state in jobs.LIVE] if not dry_run else []
    for name in {rows[n].version for n in todo}:
        cluster.master(name)  # each group being left must have a live master
    for name in todo:
        cluster.check_reachable(name)  # before anything drains: a host that does not answer is named now
    if not dry_run:
        lock.begin(settings, upgrade_key, target, old)
        todo = roll.start(settings, upgrade_key, todo, live)
    return UpgradePlan(target, todo, old, [j for j in jobs.list_jobs(settings) if j["state"] in jobs.LIVE], moves)


def verify(settings: Settings, cluster: Membership, target: str, upgrade_key: str) -> dict[str, Any]:
    lock.require_active(settings, upgrade_key)
    cluster.stop_empty_masters()  # an old group's, if the try that emptied it died first; an unused target's
    problems: list[str] = []
    with session_scope(settings.database_url) as s:
        run = s.scalar(select(UpgradeRun).where(UpgradeRun.key == upgrade_key))
        members = dict(run.members) if run else {}
        started = run.started_at if run else None
        watched = set(((run.progress or {}) if run else {}).get("jobs", []))  # running as it began
        phases = dict(((run.progress or {}) if run else {}).get("phases", {}))
        skipped = {m: p for m, p in phases.items() if p == roll.SKIPPED}
        for name in [m for m in members if m not in skipped]:
            m = s.get(Member, name)
            running = m is not None and cluster.worker_running(name)
            if m is None or m.version != target or m.status != MemberStatus.ACTIVE or not running:
                problems.append(f"member {name} is {m.status if m else 'gone'} at {m.version if m else '?'}")
        in_use = set(s.scalars(select(Member.version).where(Member.status != "STOPPED")))
        for master in s.scalars(select(Master).where(Master.status == "RUNNING")):
            if master.version not in in_use and not cluster.shared_masters:  # a platform's own masters stay up
                problems.append(f"the {master.version} master still runs with no members")
    largest = routing.target_version(settings)
    placed = {}
    for job, job_run in jobs.refresh_all(settings, cluster, fault_tolerant_only=True):
        if job_run is not None and job_run.state in jobs.LIVE:
            placed[job.name] = job_run.spark_version
            if job_run.spark_version != largest:
                problems.append(f"job {job.name} runs at {job_run.spark_version}, not on the largest group {largest}")
        elif (down := _down(settings, upgrade_key, job, job_run, watched, started)) is not None:
            problems.append(down)
    with session_scope(settings.database_url) as s:
        audit.record(s, "upgrade.verify", "upgrade", upgrade_key, outcome="failed" if problems else "ok",
                     members=members, jobs=placed, problems=problems, skipped=sorted(skipped))
    if problems:  # the lock stays: a retry may still verify; the run's `finish` task releases it as FAILED
        raise ChangeoverError(f"upgrade {upgrade_key}", "; ".join(problems),
                              "look at the audit trail with `changeover events` and retry the failed task")
    try:
        moves: list[str] | str = [move.describe() for move in _moves(settings, upgrade_key, sorted(placed), started)]
    except Exception as exc:  # noqa: BLE001 - a figure the checkpoints cannot give never fails a verified upgrade
        log.warning("upgrade %s: its moves' downtime and freshness were not measured: %s", upgrade_key, exc)
        moves = f"not measured: {exc}"
    lock.release(settings, upgrade_key, "SUCCEEDED", "verified")
    return {"target_version": target, "members": members, "jobs": placed, "skipped": sorted(skipped),
            "moves": moves}


def _moves(settings: Settings, upgrade_key: str, names: list[str], since: Any) -> list[move_history.Move]:
    """The upgrade's moves, each with its downtime and the largest wait of an input file for the sink around it,
    recorded for `changeover events` (once: a retried verify finds them recorded)."""
    moved = [move for name in names for move in move_history.of(settings, name, since)]
    move_history.record(settings, moved, upgrade_key)
    return moved


def jobs_left_down(settings: Settings, cluster: Membership, upgrade_key: str) -> list[str]:
    """Each job that ran as the upgrade began and is down now, not by anyone's stop, with the savepoint to resume
    it from: what neither a verify nor an abort may report as success."""
    with session_scope(settings.database_url) as s:
        run = s.scalar(select(UpgradeRun).where(UpgradeRun.key == upgrade_key))
        watched = set(((run.progress or {}) if run else {}).get("jobs", []))
        started = run.started_at if run else None
    down = []
    for job, job_run in jobs.refresh_all(settings, cluster, fault_tolerant_only=True):
        unconfirmed = job_run is not None and job_run.state == RunState.SUBMITTED and job_run.submission_id is None \
            and job_run.heartbeat_at is None
        if unconfirmed and job.name in watched and job.desired != Desired.STOP:  # its launch's answer was lost
            down.append(f"job {job.name}: no master has confirmed the driver of its run {job_run.id}, launched "
                        f"without an answer; it may not run{_savepoint_hint(settings, upgrade_key, job.name)}")
        elif (job_run is None or job_run.state not in jobs.LIVE) and \
                (found := _down(settings, upgrade_key, job, job_run, watched, started)) is not None:
            down.append(found)
    return down


def _down(settings: Settings, upgrade_key: str, job: Any, job_run: Any, watched: set[str],
          started: Any) -> str | None:
    if job.name not in watched or job_run is None or job.desired == Desired.STOP or job_run.ended_at is None \
            or started is None or as_utc(job_run.ended_at) < as_utc(started):
        return None
    # ended during the upgrade, not by anyone's stop: e.g. its new version failed on its first batch
    return (f"job {job.name} is down: its run {job_run.id} on Spark {job_run.spark_version} ended "
            f"{job_run.state} ({job_run.error or 'no reason recorded'})"
            f"{_savepoint_hint(settings, upgrade_key, job.name)}")


def _savepoint_hint(settings: Settings, upgrade_key: str, job: str) -> str:
    held = _savepoints_of(settings, upgrade_key, job)
    return f"; the upgrade holds its savepoint {held[-1]}, to resume it from" if held else ""


def _savepoints_of(settings: Settings, upgrade_key: str, job: str) -> list[str]:
    with session_scope(settings.database_url) as s:
        return list(s.scalars(select(Savepoint.name).where(
            Savepoint.upgrade_key == upgrade_key, Savepoint.job == job, Savepoint.status == "COMPLETED")
            .order_by(Savepoint.id)))
