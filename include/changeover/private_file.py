"""Files only this user can read, for secrets handed to other processes by reference."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def write_private(path: Path, text: str, keep_existing: bool = False) -> Path:
    """Write `text` to `path` with mode 0600 (its folder 0700), atomically: a reader sees the old content or
    the new, never half. With keep_existing, a file another process wrote first is kept, not replaced."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    scratch = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    try:
        if keep_existing:
            with contextlib.suppress(FileExistsError):
                os.link(scratch, path)
        else:
            os.replace(scratch, path)
    finally:
        scratch.unlink(missing_ok=True)
    return path
