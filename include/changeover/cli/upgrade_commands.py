"""`changeover drain`, `upgrade`, `upgrades`, `maintenance` and `events`: members drained and upgraded, the
upgrades' lock, the drain window's marks, and the audit trail that records it all."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Annotated

import typer

from changeover.cli.app import (
    JsonFlag,
    app,
    checked_settings,
    emit,
    maintenance_app,
    out,
    upgrade_app,
    upgrades_app,
)
from changeover.errors import ChangeoverError


@app.command("drain")
def drain_member(member: str, timeout: Annotated[float, typer.Option(help="Seconds before giving up.")] = 600,
                 abort: Annotated[bool, typer.Option("--abort", help="Give the member back to service instead.")]
                 = False) -> None:
    """Drain a member: savepoint and move fault-tolerant jobs, wait for blocking ones, cancel the rest."""
    from changeover.cluster import membership_for
    from changeover.upgrade import drain

    settings = checked_settings()
    cluster = membership_for(settings)
    if abort:
        given = drain.abort(settings, cluster, member, "aborted by hand")
        out().print(f"member {member} {'back in service' if given else 'was not being drained: left as it is'}")
        return
    deadline = time.monotonic() + timeout
    while not (result := drain.step(settings, cluster, member)).done:
        if result.blocked_by:
            raise ChangeoverError(f"drain of member {member}", f"member {', '.join(result.blocked_by)} is being "
                                  "drained or upgraded, and members are drained one at a time",
                                  "wait until `changeover cluster status` shows it ACTIVE, then drain again")
        if time.monotonic() > deadline:
            raise ChangeoverError(f"drain of member {member}", f"it did not finish within {timeout:.0f} s",
                                  f"see what it waits for: {result.as_dict()}")
        time.sleep(1)
    out().print(f"member {member} drained")


@upgrade_app.command("member")
def upgrade_member(member: str, to: Annotated[str, typer.Option("--to", help="Target Spark version.")]) -> None:
    """Restart a drained member on another Spark version."""
    from changeover.cluster import membership_for
    from changeover.upgrade import member_upgrade

    settings = checked_settings()
    old = member_upgrade.upgrade_member(settings, membership_for(settings), member, to)
    out().print(f"member {member}: {old} -> {to}")


UpgradeKey = Annotated[str, typer.Argument(help="The upgrade's key, DAG/RUN_ID, as `changeover upgrades` lists it.")]


@upgrade_app.command("status")
def upgrade_status(key: UpgradeKey, as_json: JsonFlag = False, follow: Annotated[bool, typer.Option(
        "--follow", help="Show the roll live until it ends: a bar of members done, each member's phase, each job's "
                         "moves and their downtime.")] = False) -> None:
    """Where an upgrade is: each member's phase and actual state, jobs asked to move, savepoints it holds."""
    if follow:
        from changeover.cli import progress

        progress.follow(checked_settings(), key)
        return
    from changeover.upgrade import recovery

    found = recovery.status(checked_settings(), key)
    if as_json:
        out().print_json(json.dumps(found))
        return
    out().print(f"upgrade {found['key']} to {found['target_version']}: {found['status']}"
             f"{' (holds the upgrade lock)' if found['locked'] else ''}, by {found['actor'] or 'unknown'}")
    emit(found["members"], False, [("MEMBER", "name"), ("PHASE", "phase"), ("STATUS", "status"),
                                   ("VERSION", "version"), ("REASON", "reason")])
    out().print(f"jobs asked to move: {', '.join(found['jobs_asked_to_move']) or 'none'}")
    out().print(f"savepoints held: {', '.join(found['savepoints']) or 'none'}")


@upgrade_app.command("abort")
def upgrade_abort(key: UpgradeKey, reason: Annotated[str, typer.Option(help="Why, for the audit.")] = "aborted by hand"
                  ) -> None:
    """Undo what a failed or abandoned upgrade left: members back in service, jobs running, savepoints released."""
    from changeover.cluster import membership_for
    from changeover.upgrade import recovery

    settings = checked_settings()
    found = recovery.abort(settings, membership_for(settings), key, reason)
    out().print(f"upgrade {key} aborted: " + ", ".join(f"{m['name']} {m['status']} at {m['version']}"
                                                    for m in found["members"]))


@upgrade_app.command("resume")
def upgrade_resume(key: UpgradeKey) -> None:
    """Take the lock again for a FAILED upgrade; then clear its Airflow run's failed tasks to go on from there."""
    from changeover.upgrade import recovery

    recovery.resume(checked_settings(), key)
    out().print(f"upgrade {key} holds the lock again: clear its failed tasks in Airflow to continue")


@app.command("events")
def events(
    limit: Annotated[int, typer.Option(help="At most this many, the newest.")] = 50,
    job: Annotated[str | None, typer.Option(help="Only actions on this job.")] = None,
    member: Annotated[str | None, typer.Option(help="Only actions on this member.")] = None,
    upgrade_key: Annotated[str | None, typer.Option("--upgrade", help="Only actions of this upgrade (run id).")] = None,
    since: Annotated[datetime | None, typer.Option(help="From this UTC time on (ISO 8601).")] = None,
    until: Annotated[datetime | None, typer.Option(help="Up to this UTC time (ISO 8601).")] = None,
    as_json: JsonFlag = False,
) -> None:
    """The audit trail, newest last: who did what to which job, member, savepoint or upgrade, and the outcome."""
    from changeover import audit
    from changeover.timeutil import as_utc

    found = audit.find(checked_settings().database_url, job=job, member=member, upgrade=upgrade_key,
                       since=_utc(since), until=_utc(until), limit=limit)
    rows = [{"at": as_utc(e.at).isoformat(timespec="seconds"), "actor": e.actor, "action": e.action,
             "subject": f"{e.subject_kind}:{e.subject}", "outcome": e.outcome, "upgrade": e.upgrade,
             "details": e.details} for e in found]
    if as_json:
        print(json.dumps(rows, indent=2, default=str))
        return
    # A block per event, not a table: an actor and its details are too long for columns in 80 characters.
    for row in rows:
        out().print(f"{row['at']}  {row['action']}  {row['outcome']}  {row['subject']}", overflow="fold")
        out().print(f"  by {row['actor']}", overflow="fold")
        details = "  ".join(f"{key}={json.dumps(value, default=str)}" for key, value in row["details"].items())
        if details:
            out().print(f"  {details}", overflow="fold")


@upgrades_app.callback()
def upgrades_list(ctx: typer.Context, as_json: JsonFlag = False) -> None:
    """Every upgrade: its key (the Airflow run id), target, status, who started it and each member's phase."""
    if ctx.invoked_subcommand is not None:
        return
    from changeover.upgrade import lock

    emit(lock.list_upgrades(checked_settings()), as_json,
         [("KEY", "key"), ("TARGET", "target_version"), ("STATUS", "status"), ("ACTOR", "actor"),
          ("STARTED", "started_at"), ("MEMBERS", "phases")])


@maintenance_app.callback()
def maintenance_list(ctx: typer.Context) -> None:
    """The members the drain_window DAG drains and upgrades next, in order."""
    if ctx.invoked_subcommand is None:
        from changeover.upgrade import maintenance

        out().print(", ".join(maintenance.marked(checked_settings())) or "no member is marked")


@maintenance_app.command("mark")
def maintenance_mark(member: str, reason: Annotated[str, typer.Option(help="Why, for the audit.")] = "upgrade") -> None:
    """Mark a member for the next drain window."""
    from changeover.upgrade import maintenance

    maintenance.mark(checked_settings(), member, reason)


@maintenance_app.command("unmark")
def maintenance_unmark(member: str) -> None:
    """Take a member off the next drain window."""
    from changeover.upgrade import maintenance

    maintenance.unmark(checked_settings(), member, "unmarked by hand")


@upgrades_app.command("release")
def upgrades_release(key: str) -> None:
    """End an upgrade whose Airflow run is gone as FAILED, so that a new one can start."""
    from changeover.upgrade import lock

    if lock.release(checked_settings(), key, "FAILED", "released by hand"):
        out().print(f"upgrade {key} released")
    else:
        out().print(f"upgrade {key} had ended already; nothing changed")


def _utc(moment: datetime | None) -> datetime | None:
    return None if moment is None else (moment if moment.tzinfo else moment.replace(tzinfo=UTC))
