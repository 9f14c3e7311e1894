"""Sinks with a declared delivery guarantee.

A declaration tells Changeover how to attach the sink to a query (its write holds the fence: `handoff.fence`), how
far it has written (to tell whether it is ahead of a savepoint), how to rewind it to a savepoint's batch, and
where to send its writes for a read-only run (`redirected`). The control plane rebuilds a declaration from
the description the driver recorded (`from_description`), without the job's code.
"""

from __future__ import annotations

from typing import Any

from changeover.errors import ChangeoverError
from changeover.runtime.sinks.base import Sink, WriteContext
from changeover.runtime.sinks.files import Files
from changeover.runtime.sinks.foreach import ForeachBatch
from changeover.runtime.sinks.keyed_table import KeyedTable, with_password_of

KINDS: dict[str, type[Sink]] = {"files": Files, "keyed_table": KeyedTable, "foreach": ForeachBatch}


def from_description(description: dict[str, Any], registry_url: str | None = None) -> Sink:
    """registry_url: whose password a keyed table on the same server and user gets (descriptions keep none)."""
    kind = description.get("kind")
    if kind not in KINDS:
        raise ChangeoverError(f"sink description {description}", f"unknown sink kind {kind!r}",
                              f"use one of {', '.join(KINDS)}")
    if kind == "keyed_table" and registry_url:
        description = {**description, "url": with_password_of(description["url"], registry_url)}
    return KINDS[kind].from_description(description)


__all__ = ["Files", "ForeachBatch", "KeyedTable", "Sink", "WriteContext", "from_description"]
