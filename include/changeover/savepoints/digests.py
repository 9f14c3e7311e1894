"""SHA-256 of files, remembered by inode so that hard-linked checkpoint files are hashed only once.

Files of committed batches never change, and a savepoint hard-links them: the next savepoint sees
the same (device, inode, size, mtime) and reuses the digest instead of reading the bytes again.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


class DigestCache:
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._known: dict[str, str] = json.loads(path.read_text())
        except (OSError, ValueError):
            self._known = {}
        self._used: dict[str, str] = {}

    @staticmethod
    def sha256(path: str | Path) -> str:
        digest = hashlib.sha256()
        with open(path, "rb") as source:
            while chunk := source.read(1 << 20):
                digest.update(chunk)
        return digest.hexdigest()

    def of(self, path: str | Path, st: os.stat_result | None = None) -> str:
        st = st or os.stat(path)
        key = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
        value = self._known.get(key) or self.sha256(path)
        self._used[key] = value
        return value

    def save(self) -> None:
        """Keep the digests of the newest savepoint's files: the next one shares most of them."""
        staging = self.path.with_suffix(".tmp")
        staging.write_text(json.dumps(self._used))
        os.replace(staging, self.path)
