"""`changeover sql` and `light`: light jobs, run through the members' Spark Connect servers (by the SQL agent, or
in this process), listed and interrupted."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from changeover.cli.app import JsonFlag, app, checked_settings, emit, light_app, out, plain_settings
from changeover.errors import ChangeoverError


@app.command("sql")
def sql(
    statement: str,
    block_shutdown: Annotated[bool, typer.Option("--block-shutdown/--no-block-shutdown", show_default=False,
                                                 help="Hold a drain of its member until it ends (the default, as "
                                                      "for SQL), or be interrupted after --shutdown-timeout.")] = True,
    shutdown_timeout: Annotated[int, typer.Option(help="Seconds a drain waits before it interrupts it.")] = 30,
    tries: Annotated[int, typer.Option(help="Members to try when a version check refuses it.")] = 3,
    agent: Annotated[bool, typer.Option(
        "--agent/--no-agent", help="Hand it to the SQL agent, which keeps Spark Connect's client loaded between "
                                   "commands (from a terminal by default, else with CHANGEOVER_SQL_AGENT=1), or "
                                   "run it in this process.")] = True,
    as_json: JsonFlag = False,
) -> None:
    """Run SQL as a light job on the largest version group, through a member's Spark Connect server."""
    from changeover.cli import sql_agent

    settings = plain_settings()
    options = {"block_shutdown": block_shutdown, "shutdown_timeout": shutdown_timeout, "tries": tries}
    answer = sql_agent.run_sql(settings, statement, **options) if agent else None
    if answer is None:
        answer = _sql_here(statement, **options)
    rows, member, version = answer["rows"], answer["member"], answer["version"]
    if as_json:
        print(json.dumps({"member": member, "version": version, "rows": rows}, indent=2, default=str))
        return
    columns = [(name.upper(), name) for name in (rows[0] if rows else {})]
    if columns:
        emit(rows, False, columns)
    out().print(f"{len(rows)} rows, on member {member} (Spark {version})")


def _sql_here(statement: str, **options: Any) -> dict[str, Any]:
    """The statement run in this process, with a session of its own (as the agent runs each statement too)."""
    import warnings

    from changeover.cli import sql_agent

    warnings.filterwarnings("ignore", message="PySpark does not yet fully support pandas", category=FutureWarning)
    from pyspark.errors import PySparkException

    from changeover import light  # the Connect client loads pandas, pyarrow and gRPC: about 3 s

    try:
        rows, where = light.run_sql(checked_settings(), statement, **options)
    except PySparkException as exc:
        raise sql_agent.spark_refusal(statement, exc) from None
    return {"rows": rows, "member": where.member, "version": where.version}


@light_app.command("list")
def light_list(
    show_all: Annotated[bool, typer.Option("--all", help="Every state, not only the running ones.")] = False,
    limit: Annotated[int, typer.Option(help="At most this many, newest first.")] = 50,
    as_json: JsonFlag = False,
) -> None:
    """Light jobs the registry holds: where each runs, for whom, and whether it holds a drain."""
    from changeover.light import ledger

    rows = [{"tag": j.tag, "state": j.state, "member": j.member, "version": j.spark_version, "user": j.user_id,
             "blocks_drain": j.block_shutdown, "started": j.started_at, "statement": j.statement or ""}
            for j in ledger.recent(checked_settings(), running_only=not show_all, limit=limit)]
    if as_json or rows:
        emit(rows, as_json, [("TAG", "tag"), ("STATE", "state"), ("MEMBER", "member"), ("VERSION", "version"),
                             ("USER", "user"), ("BLOCKS DRAIN", "blocks_drain"), ("STATEMENT", "statement")])
    if not as_json:
        out().print(f"{len(rows)} light jobs{'' if show_all else ' running'}")


@light_app.command("interrupt")
def light_interrupt(tag: str, reason: Annotated[str, typer.Option(help="Recorded with the job.")] = "asked from the CLI"
                    ) -> None:
    """Interrupt a running light job's operations on its server, by its tag."""
    from changeover import light
    from changeover.light import ledger

    settings = checked_settings()
    job = ledger.get(settings, tag)
    if job.state != "RUNNING":
        raise ChangeoverError(f"light job {tag}", f"it is {job.state}, not running", "list running ones with "
                              "`changeover light list`")
    done = light.interrupt(settings, tag, reason)
    out().print(f"light job {tag} interrupted ({len(done)} operations) on member {job.member}")
