"""What runs inside a Spark driver: the job contract, the sinks, the stages' query plans (`plan`), and the stop and
hand-over protocol.

A job file imports from here only: `from changeover.runtime import Stage, KeyedTable, Files, ForeachBatch`.
"""

from changeover.runtime.contract import JobContext, Stage
from changeover.runtime.sinks import Files, ForeachBatch, KeyedTable, Sink

__all__ = ["Files", "ForeachBatch", "JobContext", "KeyedTable", "Sink", "Stage"]
