"""Where Changeover keeps its state. Every path and URL can be set by environment variable."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Settings:
    home: Path
    database_url: str
    runtimes_dir: Path

    @property
    def cluster_dir(self) -> Path:
        return self.home / "cluster"

    @property
    def checkpoint_dir(self) -> Path:
        return self.home / "checkpoints"

    @property
    def savepoint_dir(self) -> Path:
        return self.home / "savepoints"

    @property
    def data_dir(self) -> Path:
        return self.home / "data"

    @classmethod
    def from_env(cls, home: str | Path | None = None, database_url: str | None = None) -> Settings:
        root = Path(home or os.environ.get("CHANGEOVER_HOME") or CHECKOUT / ".changeover").resolve()
        url = database_url or os.environ.get("CHANGEOVER_DATABASE_URL") or f"sqlite:///{root / 'registry.db'}"
        runtimes = Path(os.environ.get("CHANGEOVER_RUNTIMES") or CHECKOUT / ".runtimes").resolve()
        return cls(home=root, database_url=url, runtimes_dir=runtimes)

    def as_env(self) -> dict[str, str]:
        return {
            "CHANGEOVER_HOME": str(self.home),
            "CHANGEOVER_DATABASE_URL": self.database_url,
            "CHANGEOVER_RUNTIMES": str(self.runtimes_dir),
        }
