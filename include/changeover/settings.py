"""Where Changeover keeps its state. Every path and URL can be set by environment variable."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from changeover.errors import ChangeoverError
from changeover.private_file import write_private

CHECKOUT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Settings:
    home: Path
    database_url: str
    runtimes_dir: Path
    rest_key_path: Path | None = None  # see rest_key_file
    cluster_file: Path | None = None  # a standalone cluster Changeover did not start (`cluster.platform`)

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

    @property
    def rest_key_configured(self) -> bool:
        """Whether a user named the key file: then it must exist; the default one is created on first use."""
        return self.rest_key_path is not None or bool(os.environ.get("CHANGEOVER_REST_KEY_FILE"))

    @property
    def rest_key_file(self) -> Path:
        """The key that signs submissions to the masters' REST servers: CHANGEOVER_REST_KEY_FILE, else one
        created under the home on first use."""
        return self.rest_key_path or Path(os.environ.get("CHANGEOVER_REST_KEY_FILE")
                                          or self.home / "secrets" / "spark-rest-key")

    @classmethod
    def from_env(cls, home: str | Path | None = None, database_url: str | None = None,
                 rest_key_file: str | Path | None = None, cluster_file: str | Path | None = None) -> Settings:
        root = Path(home or os.environ.get("CHANGEOVER_HOME") or CHECKOUT / ".changeover").resolve()
        # the reference a parent process hands its children wins over a URL left in a shell's environment
        url = (database_url or _read_reference() or os.environ.get("CHANGEOVER_DATABASE_URL")
               or f"sqlite:///{root / 'registry.db'}")
        runtimes = Path(os.environ.get("CHANGEOVER_RUNTIMES") or CHECKOUT / ".runtimes").resolve()
        cluster = cluster_file or os.environ.get("CHANGEOVER_CLUSTER_FILE")
        return cls(home=root, database_url=url, runtimes_dir=runtimes,
                   rest_key_path=Path(rest_key_file) if rest_key_file else None,
                   cluster_file=Path(cluster).resolve() if cluster else None)

    def as_env(self) -> dict[str, str]:
        """What a child process (a driver, Airflow, the CLI) needs to find the same registry. The registry URL
        goes by reference: a file only this user can read, so its password is in no process environment, no
        Spark submission and no log line."""
        return {
            "CHANGEOVER_HOME": str(self.home),
            "CHANGEOVER_DATABASE_URL_FILE": str(self.write_reference()),
            "CHANGEOVER_RUNTIMES": str(self.runtimes_dir),
            **({"CHANGEOVER_CLUSTER_FILE": str(self.cluster_file)} if self.cluster_file else {}),
            **({"CHANGEOVER_REST_KEY_FILE": str(self.rest_key_path)} if self.rest_key_path else {}),
        }

    def write_reference(self) -> Path:
        """The registry URL in `home/secrets/registry-url`, mode 0600, rewritten only when it changed."""
        path = self.home / "secrets" / "registry-url"
        if not path.exists() or path.read_text() != self.database_url:
            write_private(path, self.database_url)
        return path


def _read_reference() -> str | None:
    path = os.environ.get("CHANGEOVER_DATABASE_URL_FILE")
    if not path:
        return None
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        raise ChangeoverError(f"the registry URL file {path} (CHANGEOVER_DATABASE_URL_FILE)",
                              f"it cannot be read: {exc.strerror}",
                              "point it at the file Changeover wrote under its home's secrets/ folder, or unset "
                              "it and set CHANGEOVER_DATABASE_URL") from None


def registry_url() -> str:
    """The registry URL of this process's settings: what a job's own sink uses when no other URL is given."""
    return Settings.from_env().database_url
