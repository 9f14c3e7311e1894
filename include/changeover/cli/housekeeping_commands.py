"""`changeover leaks` and `reconcile`: clean what crashes and lost processes left behind."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from changeover.cli.app import JsonFlag, app, checked_settings, emit, out


@app.command("leaks")
def leaks_check(
    grace: Annotated[float, typer.Option(help="Seconds a leak must be seen before it is cleaned.")] = 600,
    as_json: JsonFlag = False,
) -> None:
    """Find what the registry and Spark disagree on (runs, drivers, light jobs, PID files, staging folders) and
    clean what has been seen for longer than the grace, as the leak_checker DAG does."""
    from changeover.cluster import membership_for
    from changeover.housekeeping import leaks

    settings = checked_settings()
    report = leaks.check(settings, membership_for(settings), grace).as_dict()
    if as_json:
        print(json.dumps(report, indent=2, default=str))
        return
    found = report["found"]
    if found:
        emit(found, False, [("KIND", "kind"), ("SUBJECT", "subject"), ("STATE", "state"),
                            ("SEEN FOR (S)", "seen_for"), ("WHY", "why")])
    out().print(f"{len(found)} found, {len(report['cleaned'])} cleaned")
    for refusal in report["refused"]:
        out().print(f"refused: {refusal}")


@app.command("reconcile")
def reconcile() -> None:
    """Remove what crashed savepoints left behind: PENDING rows and staging folders."""
    from changeover import savepoints

    removed = savepoints.reconcile(checked_settings())
    rows, folders = ", ".join(removed["rows"]) or "none", ", ".join(removed["folders"]) or "none"
    out().print(f"removed rows: {rows}; folders: {folders}")
