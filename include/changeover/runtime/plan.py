"""A stage's stateful plan, read from its analysed plan without starting it (runs where pyspark runs).

Walks the JVM plan through py4j: Spark's plan JSON drops the fields that matter here (watermark delays,
source options). Window parameters are read back from the expressions the analyser expands a window into.
The result is plain JSON, so the driver can record it for savepoints and the checker can read it on a host
without Spark.
"""

from __future__ import annotations

import json
import re
from typing import Any

STATEFUL_NODES = {
    "Aggregate": "aggregation",
    "Deduplicate": "dedup",
    "DeduplicateWithinWatermark": "dedup_within_watermark",
    "FlatMapGroupsWithState": "flat_map_groups_with_state",
    "FlatMapGroupsInPandasWithState": "flat_map_groups_with_state",
    "TransformWithState": "transform_with_state",
    "TransformWithStateInPySpark": "transform_with_state",
    "TransformWithStateInPandas": "transform_with_state",
}
WINDOW_FUNCTIONS = {"window", "session_window"}


def _seq(scala_seq: Any) -> list[Any]:
    return [scala_seq.apply(i) for i in range(scala_seq.size())]


def _field(expression: Any) -> dict[str, Any]:
    """A named column, or an expression (e.g. groupBy(length("key"))) under its SQL text."""
    named = expression.getClass().getSimpleName() in ("AttributeReference", "Alias")
    return {"name": expression.name() if named else expression.sql(),
            "type": json.loads(expression.dataType().json())}


def _walk(node: Any) -> list[Any]:
    """Every node of a plan or expression tree, parents before children."""
    found, stack = [], [node]
    while stack:
        current = stack.pop()
        found.append(current)
        stack.extend(reversed(_seq(current.children())))
    return found


def _aggregates(node: Any) -> list[dict[str, Any]]:
    functions = []
    for expression in _seq(node.aggregateExpressions()):
        for part in _walk(expression):
            if part.nodeName() == "AggregateExpression":
                function = part.aggregateFunction()
                functions.append({
                    "function": function.prettyName(),
                    "inputs": [json.loads(c.dataType().json()) for c in _seq(function.children())],
                    "buffer": [_field(a) for a in _seq(function.aggBufferAttributes())],
                })
    return functions


def _seconds(micros: str) -> str:
    seconds = int(micros) / 1_000_000
    return f"{seconds:g} seconds"


def _window(aggregate: Any, attribute: str) -> dict[str, Any] | None:
    """The window behind a grouping column, read from the expressions Spark's analyser expanded it into:
    `ts - (ts - start) % slide` and `+ duration` for time windows, `ts + gap` for session windows."""
    for node in _walk(aggregate.child()):
        text = node.toString()
        if node.nodeName() not in ("Project", "Expand") or "named_struct(start" not in text:
            continue
        column = re.search(r"precisetimestampconversion\((\w+)#", text)
        if attribute == "session_window":
            gap = re.search(r"\+ cast\((.+?) as interval\)", text)
            return {"kind": "session", "column": column and column.group(1), "gap": gap and gap.group(1)}
        slide, duration = re.search(r"% (\d+)\)", text), re.search(r"\+ (\d+)\), LongType, TimestampType\)", text)
        if not (slide and duration):
            return None
        kind = "tumbling" if slide.group(1) == duration.group(1) else "sliding"
        return {"kind": kind, "column": column and column.group(1), "duration": _seconds(duration.group(1)),
                "slide": _seconds(slide.group(1))}
    return None


def _source(node: Any, jvm: Any) -> dict[str, Any]:
    if node.nodeName() == "StreamingRelation":
        source = node.dataSource()
        options = dict(jvm.scala.jdk.javaapi.CollectionConverters.asJava(source.options()))
        return {"format": source.className(), "options": options}
    options = dict(node.extraOptions().asCaseSensitiveMap())
    return {"format": node.sourceName(), "options": options}


def _operator(node: Any) -> dict[str, Any] | None:
    name = node.nodeName()
    if not node.isStreaming():
        return None  # e.g. an aggregation on the static side of a join
    if name == "Join":
        if not all(child.isStreaming() for child in _seq(node.children())):
            return None  # a stream-static join keeps no state
        condition = node.condition()
        return {"kind": "join", "join_type": node.joinType().sql(),
                "condition": condition.get().sql() if condition.isDefined() else None, "keys": [], "value": []}
    if name == "GlobalLimit":
        return {"kind": "limit", "keys": [], "value": []}
    kind = STATEFUL_NODES.get(name)
    if kind is None:
        return None
    if kind == "aggregation":
        keys = [_field(e) for e in _seq(node.groupingExpressions())]
        aggregates = _aggregates(node)
        entry: dict[str, Any] = {"kind": kind, "keys": keys, "aggregates": aggregates,
                                 "value": [f for a in aggregates for f in a["buffer"]]}
        windowed = [k["name"] for k in keys if k["name"] in WINDOW_FUNCTIONS]
        if windowed:
            entry["window"] = _window(node, windowed[0])
            entry["kind"] = "session_window" if windowed[0] == "session_window" else kind
        return entry
    if kind in ("dedup", "dedup_within_watermark"):
        return {"kind": kind, "keys": [_field(k) for k in _seq(node.keys())], "value": []}
    state = None
    for accessor in ("stateEncoder", "stateType", "outputObjAttr"):
        if hasattr(node, accessor):
            try:
                value = getattr(node, accessor)()
                state = json.loads(value.schema().json()) if hasattr(value, "schema") else str(value)
                break
            except Exception:  # noqa: BLE001 - accessors differ across Spark versions; the kind still counts
                continue
    return {"kind": kind, "keys": [], "value": [], "state_schema": state}


def describe(spark: Any, name: str, frame: Any, output_mode: str, sink: dict[str, Any]) -> dict[str, Any]:
    """One stage: its sources, watermarks and stateful operators (top of the plan first), and its sink."""
    execution = frame._jdf.queryExecution()
    operators, sources, watermarks = [], [], []
    for node in _walk(execution.analyzed()):
        kind = node.nodeName()
        if kind in ("StreamingRelation", "StreamingRelationV2"):
            sources.append(_source(node, spark._jvm))
        elif kind == "EventTimeWatermark":
            watermarks.append({"column": node.eventTime().name(), "delay": node.delay().toString()})
        elif (operator := _operator(node)) is not None:
            operators.append(operator)
    return {"stage": name, "output_mode": output_mode, "sink": sink, "sources": sources,
            "watermarks": watermarks, "operators": operators,
            "shuffle_partitions": int(spark.conf.get("spark.sql.shuffle.partitions"))}


def describe_stages(spark: Any, stages: list[Any]) -> dict[str, dict[str, Any]]:
    return {stage.name: describe(spark, stage.name, stage.frame, stage.output_mode, stage.sink.describe())
            for stage in stages}
