"""The Typer apps of the `changeover` command, and what its commands share: the settings, the console, tables.

Only Typer and the standard library load with the CLI's modules, so that `changeover --help` and every command's
help answer at once: each command imports what it uses (SQLAlchemy, Alembic, Rich's tables, Spark Connect, the core
packages) in its own body. Help is Click's plain layout (`rich_markup_mode=None`): it never cuts an option's name
in an 80-column terminal, as Rich's option table does, and it needs no Rich.
"""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer.core import TyperGroup

if TYPE_CHECKING:
    from rich.console import Console

    from changeover.settings import Settings


class _Group(TyperGroup):
    """Typer's group, where a flag not given reads False rather than None. Typer 0.29 coerces a None through a
    Pydantic adapter, and imports Pydantic to build it (about 0.35 s of CPU): a group's own --help and completion
    flags are read on every command line, so `changeover submit --help` paid that for nothing."""

    def get_params(self, ctx: Any) -> list[Any]:
        params = super().get_params(ctx)
        for param in params:
            if getattr(param, "is_flag", False) and param.default is None:
                param.default = False
        return params


def _typer(help: str, **kwargs: Any) -> typer.Typer:  # noqa: A002 - Typer's own name for it
    return typer.Typer(help=help, rich_markup_mode=None, cls=_Group, **kwargs)


app = _typer("Upgrade running PySpark jobs without losing their state.", no_args_is_help=True)
cluster_app = _typer("Start, stop and inspect the local Spark cluster.", no_args_is_help=True)
runtime_app = _typer("Spark runtimes, one per version.", no_args_is_help=True)
app.add_typer(cluster_app, name="cluster")
app.add_typer(runtime_app, name="runtime")
upgrades_app = _typer("Rolling upgrades: list them, release a stuck one.", invoke_without_command=True)
app.add_typer(upgrades_app, name="upgrades")
upgrade_app = _typer("One member's upgrade, and a failed upgrade's status, abort or resume.", no_args_is_help=True)
app.add_typer(upgrade_app, name="upgrade")
db_app = _typer("The registry's schema.", no_args_is_help=True)
app.add_typer(db_app, name="db")
maintenance_app = _typer("Members marked for the next drain window.", invoke_without_command=True)
app.add_typer(maintenance_app, name="maintenance")
light_app = _typer("Light jobs: SQL and DataFrames run through the members' Connect servers.", no_args_is_help=True)
app.add_typer(light_app, name="light")


@functools.cache
def out() -> Console:
    """Rich's console, made (and Rich loaded) on a command's first print. Markup off: job code, paths and Spark's
    messages hold brackets that Rich would read as tags."""
    from rich.console import Console

    return Console(markup=False, highlight=False)


JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def checked_settings() -> Settings:
    """The registry as this code's schema has it; migrating is `db upgrade`'s alone, so that a newer CLI never moves
    a shared registry ahead of the Airflow workers that use it."""
    from changeover.registry.schema import require_current

    settings = plain_settings()
    require_current(settings.database_url)
    return settings


def plain_settings() -> Settings:
    """The settings alone, for the commands that need no registry or migrate it themselves."""
    from changeover.settings import Settings

    return Settings.from_env()


def emit(rows: list[dict[str, Any]] | dict[str, Any], as_json: bool, columns: list[tuple[str, str]]) -> None:
    if as_json:
        print(json.dumps(rows, indent=2, default=str))
        return
    from rich.table import Table

    table = Table(*[title for title, _ in columns])
    for row in rows if isinstance(rows, list) else [rows]:
        table.add_row(*[f"{row[key]:,}" if isinstance(row[key], int) and not isinstance(row[key], bool)
                        else str(row[key]) for _, key in columns])
    out().print(table)
