"""The checker's rules that the Spark matrix (test_compat_matrix.py) does not reach, on plans written by hand
in the shape `changeover.runtime.plan` gives. No Spark: these are the comparisons alone."""

from __future__ import annotations

from typing import Any

from changeover.compat.checker import check
from changeover.compat.rules import RULES, Verdict

KEY = {"name": "key", "type": "string"}


def stage(**changes: Any) -> dict[str, Any]:
    """A savepoint's stage entry: a join's state files and the plan the driver recorded."""
    plan = {"stage": "joined", "output_mode": "append", "shuffle_partitions": 4,
            "sink": {"kind": "keyed_table", "table": "matches", "keys": ["seq"]},
            "sources": [{"format": "json", "options": {"path": "/in/clicks"}},
                        {"format": "json", "options": {"path": "/in/views"}}],
            "watermarks": [{"column": "ts", "delay": "10 seconds"}],
            "operators": [{"kind": "join", "join_type": "INNER", "condition": "(key = key)", "keys": [],
                           "value": []}]}
    for path, value in changes.items():
        target = plan
        *parents, leaf = path.split("__")
        for part in parents:
            target = target[int(part)] if part.isdigit() else target[part]
        target[leaf] = value
    operators = [{"operator_id": 0, "operator_name": "symmetricHashJoin", "key_schema": {"fields": [KEY]},
                  "value_schema": {"fields": [KEY]}}]
    return {"operators": operators, "plan": plan}


def rules_of(saved: dict[str, Any], new: dict[str, Any], **kwargs: Any) -> tuple[set[str], Verdict]:
    report = check("team", "team/sp", {"joined": saved}, {"joined": new["plan"]}, **kwargs)
    return {f.rule for f in report.findings}, report.verdict


def test_an_unchanged_join_is_compatible() -> None:
    assert rules_of(stage(), stage()) == (set(), Verdict.COMPATIBLE)


def test_join_type_or_keys_changed_is_incompatible() -> None:
    assert rules_of(stage(), stage(operators__0__join_type="LEFT OUTER")) == ({"CO-JOIN-01"}, Verdict.INCOMPATIBLE)
    assert rules_of(stage(), stage(operators__0__condition="(seq = seq)"))[0] == {"CO-JOIN-01"}


def test_source_options_watermark_sink_and_mode_changes_warn() -> None:
    moved = [{"format": "json", "options": {"path": "/in/clicks-v2"}},
             {"format": "json", "options": {"path": "/in/views"}}]
    assert rules_of(stage(), stage(sources=moved)) == ({"CO-SRC-02"}, Verdict.COMPATIBLE_WITH_WARNING)
    assert rules_of(stage(), stage(watermarks=[{"column": "ts", "delay": "1 minute"}]))[0] == {"CO-WM-01"}
    assert rules_of(stage(), stage(sink={"kind": "files", "path": "/out"}))[0] == {"CO-SINK-01"}
    assert rules_of(stage(), stage(output_mode="update"))[0] == {"CO-MODE-01"}


def test_a_source_of_another_type_is_incompatible() -> None:
    kafka = [{"format": "kafka", "options": {"subscribe": "clicks"}}, {"format": "json", "options": {}}]
    assert rules_of(stage(), stage(sources=kafka)) == ({"CO-SRC-01"}, Verdict.INCOMPATIBLE)


def test_a_savepoint_without_a_plan_is_checked_on_its_state_schemas_and_says_so() -> None:
    saved = stage()
    saved["plan"] = None
    assert rules_of(saved, stage()) == ({"CO-PLAN-01"}, Verdict.COMPATIBLE_WITH_WARNING)


def test_a_stateful_operator_added_to_a_stage_is_incompatible() -> None:
    grown = stage()
    grown["plan"]["operators"].append({"kind": "dedup", "keys": [KEY], "value": []})
    assert rules_of(stage(), grown) == ({"CO-OPS-01"}, Verdict.INCOMPATIBLE)


def test_a_rename_naming_an_unknown_stage_is_refused_with_both_stage_lists() -> None:
    report = check("team", "team/sp", {"joined": stage()}, {"joined": stage()["plan"]}, {"joinde": "joined"})
    (finding,) = report.findings
    assert finding.rule == "CO-STAGE-06" and "the savepoint has ['joined']" in finding.detail


def test_every_rule_is_filed_under_its_own_id_with_a_title_and_a_fix() -> None:
    assert [key for key, rule in RULES.items() if rule.id != key or not rule.fix or not rule.title] == []
