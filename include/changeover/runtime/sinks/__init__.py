"""Sinks with a declared delivery guarantee.

A declaration tells Changeover how to attach the sink to a query (its write holds the fence: `handoff.fence`), how
far it has written (to tell whether it is ahead of a savepoint), how to rewind it to a savepoint's batch, and
where to send its writes for a read-only run (`redirected`). The control plane rebuilds a declaration from
the description the driver recorded (`from_description`), without the job's code.
"""

from __future__ import annotations

from changeover.runtime.sinks.base import Sink, WriteContext
from changeover.runtime.sinks.described import from_description, hold_a_write_of
from changeover.runtime.sinks.files import Files
from changeover.runtime.sinks.foreach import ForeachBatch
from changeover.runtime.sinks.keyed_table import KeyedTable

__all__ = ["Files", "ForeachBatch", "KeyedTable", "Sink", "WriteContext", "from_description", "hold_a_write_of"]
