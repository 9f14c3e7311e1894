"""Savepoints: a consistent copy of every stage's checkpoint at a committed batch, with a manifest.

Two modes, as in Flink: `stop` copies the checkpoints of a run that stopped at a batch boundary;
`continue` copies a running job's checkpoints as of their last committed batch, without stopping it.

A savepoint is registered PENDING, built under a staging folder (hard links where the store shares
the checkpoints' filesystem), given a manifest with every file's size and SHA-256, renamed into
place, and only then marked COMPLETED. A crash at any moment leaves a complete savepoint or, after
`reconcile`, none. Restoring verifies every checksum first.

Taking one is in `savepoints.taking`, restoring one in `savepoints.restoring`, deleting, the retention policy and
`reconcile` in `savepoints.retention`; this package re-exports them.
"""

from changeover.savepoints.restoring import MANIFEST, completed, completed_in, get_savepoint, restore, verify
from changeover.savepoints.retention import apply_retention, delete, list_savepoints, reconcile
from changeover.savepoints.taking import (
    FORMAT,
    MODES,
    check_available,
    code_fingerprint,
    describe_operators,
    lease_seconds,
    request_stop,
    take,
)

__all__ = [
    "FORMAT", "MANIFEST", "MODES", "apply_retention", "check_available", "code_fingerprint", "completed",
    "completed_in", "delete", "describe_operators", "get_savepoint", "lease_seconds", "list_savepoints", "reconcile",
    "request_stop", "restore", "take", "verify",
]
