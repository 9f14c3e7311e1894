"""The `changeover` command: its entry point, with every command registered.

The commands live in a module per family, on the Typer apps of `changeover.cli.app`; importing them here registers
them, in the order `changeover --help` lists them. Like `app`, they load only Typer and the standard library: each
command imports what it uses in its own body.
"""

from __future__ import annotations

import atexit
import gc
import sys
from typing import Annotated

import typer

from changeover.cli.app import app
from changeover.errors import ChangeoverError

# The order the commands register in is the order help lists them in.
# isort: off
from changeover.cli import job_commands  # noqa: F401
from changeover.cli import savepoint_commands  # noqa: F401
from changeover.cli import light_commands  # noqa: F401
from changeover.cli import housekeeping_commands  # noqa: F401
from changeover.cli import upgrade_commands  # noqa: F401
from changeover.cli import cluster_commands  # noqa: F401
# isort: on

__all__ = ["app", "main"]


@app.command("demo")
def demo(
    keep_airflow: Annotated[bool, typer.Option("--keep-airflow", help="Leave Airflow running afterwards.")] = False,
) -> None:
    """Roll a live stateful job through a rolling Spark upgrade, triggered in a real Airflow as the UI does."""
    from changeover.cli.demo import run_demo

    raise typer.Exit(run_demo(keep_airflow))


def main() -> None:
    # At exit, what the command loaded (Spark Connect's client, pandas, SQLAlchemy) is left to the process's end
    # rather than collected by the interpreter's teardown: `changeover sql --no-agent` ends 0.6 s sooner.
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
    try:
        app()
    except ChangeoverError as exc:
        from rich.console import Console
        from rich.text import Text

        Console(stderr=True, highlight=False).print(Text.assemble(("error: ", "bold red"), str(exc)), soft_wrap=True)
        sys.exit(2)
