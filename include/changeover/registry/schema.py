"""Bring a registry database to the newest Alembic revision, or check that it is there."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from changeover.errors import ChangeoverError
from changeover.registry.db import engine_for

MIGRATIONS = Path(__file__).parent / "migrations"


def _config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def migrate(url: str, revision: str = "head") -> None:
    command.upgrade(_config(url), revision)


def require_current(url: str) -> None:
    """Refuse a registry whose schema is not this code's: Airflow's tasks and triggers only read the revision
    (migrating is a deliberate step, `changeover db upgrade`, not a side effect of every task)."""
    scripts = ScriptDirectory.from_config(_config(url))
    head = scripts.get_current_head()
    with engine_for(url).connect() as connection:
        current = MigrationContext.configure(connection).get_current_revision()
    if current == head:
        return
    where = f"the registry at {engine_for(url).url.render_as_string(hide_password=True)}"
    if current is not None and current not in {rev.revision for rev in scripts.walk_revisions()}:
        raise ChangeoverError(where, f"its schema is at revision {current}, newer than this code's {head}: a newer "
                              "Changeover migrated it", "install that Changeover version here too")
    raise ChangeoverError(where, f"its schema is at revision {current or 'none'}, and this code needs {head}",
                          "run `changeover db upgrade` with the same registry settings (the Makefile's airflow-db "
                          "step does it for the embedded default)")
