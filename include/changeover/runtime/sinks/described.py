"""Sinks rebuilt from the descriptions their drivers recorded, by the control plane and the parked run, without the
job's code: `from_description`, and whether the described sinks hold a run's write (`hold_a_write_of`)."""

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


def hold_a_write_of(url: str, job: str, descriptions: dict[str, dict[str, Any]], run: int) -> bool:
    """Whether a sink's own store holds a batch `run` wrote, for the sinks described (stage -> description): what
    the sink has written is the truth, and the registry's record of it commits apart for a sink in another
    database. The parked run's lease asks it through `handoff.lease.next_action`, which takes it as an argument."""
    return any(from_description(description, url).written_by(WriteContext(url, job, stage, run))
               for stage, description in descriptions.items())
