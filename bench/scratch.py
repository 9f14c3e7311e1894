"""A benchmark's own throwaway home: a fresh folder under .changeover/bench with a migrated SQLite registry."""

from __future__ import annotations

import tempfile
from pathlib import Path

from changeover.registry.schema import migrate
from changeover.settings import CHECKOUT, Settings


def scratch_settings(prefix: str) -> tuple[Settings, Path]:
    base = CHECKOUT / ".changeover" / "bench"
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{prefix}-", dir=base))
    settings = Settings.from_env(home=work / "home", database_url=f"sqlite:///{work / 'registry.db'}")
    migrate(settings.database_url)
    return settings, work
