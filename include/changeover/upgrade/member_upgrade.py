"""Member upgrade and the rebalance of fault-tolerant jobs onto the largest version group."""

from __future__ import annotations

from sqlalchemy import select

from changeover import audit, jobs
from changeover.cluster import IDLE_STOP_GRACE, STOP_GRACE, Membership, get_member, routing
from changeover.cluster.runtimes import check_version, find_runtime
from changeover.errors import ChangeoverError
from changeover.registry.db import session_scope
from changeover.registry.models import STOPPING, Job
from changeover.registry.states import AT_A_BOUNDARY, Desired, MemberStatus
from changeover.settings import Settings
from changeover.upgrade import relocate


def upgrade_member(settings: Settings, cluster: Membership, member: str, version: str) -> str:
    """Restart a drained member's worker from the new runtime. Returns the version it had before."""
    check_version(version)
    find_runtime(settings.runtimes_dir, version)
    with session_scope(settings.database_url) as s:
        row = get_member(s, member)
        old, status = row.version, row.status
        if old == version and status == "ACTIVE":
            return old  # already done: a retried task changes nothing
        if status not in ("DRAINED", "UPGRADING", "STOPPED"):
            raise ChangeoverError(f"upgrade of member {member}", f"it is {status}, and jobs may still run on it",
                                  f"drain it first with `changeover drain {member}`")
        row.status = MemberStatus.UPGRADING
        audit.record(s, "member.upgrade.begin", "member", member, from_version=old, to_version=version)
    # Drained: no driver runs there, and executors still on it are past their grace (the drain's executors_left;
    # their drivers rerun their tasks), so no need to wait on its shutdown hooks. A half-restarted worker from a
    # try that died may already host drivers the new group's master placed: those get the full grace.
    idle = not jobs.drivers_on(settings, cluster, member)
    cluster.stop_worker(member, grace=IDLE_STOP_GRACE if idle else STOP_GRACE)
    cluster.start_worker(member, version)
    with session_scope(settings.database_url) as s:  # back in service: what follows is the old group's cleanup
        audit.record(s, "member.upgrade", "member", member, from_version=old, to_version=version)
    if old != version:
        cluster.stop_master_if_empty(old)
    return old


def rebalance_step(settings: Settings, cluster: Membership, upgrade_key: str | None = None) -> list[str]:
    """Move fault-tolerant jobs that run off the largest group. Returns the jobs still moving."""
    target = routing.target_version(settings)
    moving = []
    for job, run in jobs.refresh_all(settings, cluster, fault_tolerant_only=True):
        if run is None or job.desired == Desired.STOP or (run.state not in (*jobs.LIVE, *AT_A_BOUNDARY)
                                                     and job.desired != Desired.MOVE):
            continue  # not running, or stopped by a user: not ours to move; one ended mid-move still is
        if not relocate.step(settings, cluster, job.name, target, reason=f"rebalance-{target}",
                             upgrade_key=upgrade_key):
            moving.append(job.name)
    return moving


def jobs_stopping(settings: Settings) -> list[str]:
    """Fault-tolerant jobs asked to stop whose driver has not reached a batch boundary yet."""
    with session_scope(settings.database_url) as s:
        stopping = []
        for job in s.scalars(select(Job).where(Job.desired.in_(STOPPING))):
            run = jobs.current_run(s, job)
            if run is not None and run.state in jobs.LIVE:
                stopping.append(job.name)
        return stopping
