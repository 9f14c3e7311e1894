"""The static check: a job's new stage plans against a savepoint's manifest, one finding per rule broken.

The manifest's state schemas are the truth of what the state holds; its recorded plans (savepoints taken
since the driver records them) add windows, joins, sources, sinks and settings.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from changeover.compat.rules import RULES, Verdict

OPERATOR_KINDS = {  # operator names that Spark's state-metadata reader gives, and the plan's kinds
    "stateStoreSave": "aggregation",
    "sessionWindowStateStoreSaveExec": "session_window",
    "dedupe": "dedup",
    "dedupeWithinWatermark": "dedup_within_watermark",
    "symmetricHashJoin": "join",
    "flatMapGroupsWithState": "flat_map_groups_with_state",
    "transformWithStateExec": "transform_with_state",
    "transformWithStateInPySparkExec": "transform_with_state",
    "globalLimit": "limit",
}
WINDOWED = {"aggregation", "session_window"}
# Names a loop or a library makes up: stage_0, query-3, 7, or a hex id.
GENERATED_NAME = re.compile(r"(?i)(stage|query|stream|sink|q|s)?[-_]?\d+|[0-9a-f]{8,}(-[0-9a-f]{4,})*")


@dataclass(frozen=True)
class Finding:
    rule: str
    verdict: Verdict
    job: str
    stage: str
    operator: int | None
    detail: str
    fix: str

    def line(self) -> str:
        where = f"job {self.job}, stage {self.stage}" + (f", operator {self.operator}" if self.operator is not None
                                                          else "")
        return f"[{self.verdict.name}] {self.rule} {where}: {RULES[self.rule].title}: {self.detail}. Fix: {self.fix}"


@dataclass
class Report:
    job: str
    savepoint: str
    findings: list[Finding] = field(default_factory=list)
    dry_run: dict[str, Any] | None = None  # per stage: the batch replayed and its input rows, or the error

    @property
    def verdict(self) -> Verdict:
        return max((f.verdict for f in self.findings), default=Verdict.COMPATIBLE)

    def stage_verdicts(self) -> dict[str, str]:
        verdicts: dict[str, Verdict] = {}
        for finding in self.findings:
            verdicts[finding.stage] = max(verdicts.get(finding.stage, Verdict.COMPATIBLE), finding.verdict)
        return {stage: verdict.name for stage, verdict in sorted(verdicts.items())}

    def passes(self, allow_non_restored_state: bool = False) -> bool:
        worst = Verdict.COMPATIBLE_WITH_WARNING if not allow_non_restored_state else Verdict.NEEDS_DISCARD
        return self.verdict <= worst

    def as_dict(self) -> dict[str, Any]:
        return {"job": self.job, "savepoint": self.savepoint, "verdict": self.verdict.name,
                "stages": self.stage_verdicts(),
                "findings": [{**asdict(f), "verdict": f.verdict.name, "title": RULES[f.rule].title}
                             for f in self.findings], "dry_run": self.dry_run}

    def render(self) -> str:
        head = f"job {self.job} against savepoint {self.savepoint}: {self.verdict.name}"
        replayed = [f"  dry run: stage {stage} replayed batch {r['batch']} ({r['input_rows']} input rows), "
                    "its output suppressed" for stage, r in (self.dry_run or {}).items()
                    if isinstance(r, dict) and "batch" in r]
        return "\n".join([head, *(f"  {f.line()}" for f in self.findings), *replayed])

    def add(self, rule: str, stage: str, detail: str, operator: int | None = None) -> None:
        spec = RULES[rule]
        self.findings.append(Finding(rule, spec.verdict, self.job, stage, operator, detail, spec.fix))


def _bare(data_type: Any) -> Any:
    """A Spark type's JSON without nullability and metadata, which plans and state files record differently."""
    if isinstance(data_type, dict):
        return {k: _bare(v) for k, v in data_type.items()
                if k not in ("nullable", "metadata", "containsNull", "valueContainsNull")}
    if isinstance(data_type, list):
        return [_bare(v) for v in data_type]
    return data_type


def _fields(schema: dict[str, Any] | None) -> list[dict[str, Any]]:
    return [{"name": f["name"], "type": _bare(f["type"])} for f in (schema or {}).get("fields", [])]


def _normalized(operator: dict[str, Any]) -> dict[str, Any]:
    return {**operator, **{part: [{"name": f["name"], "type": _bare(f["type"])} for f in operator.get(part, [])]
                           for part in ("keys", "value")}}


def _type_text(value: Any) -> str:
    if isinstance(value, dict):
        inner = ",".join(f"{f['name']}:{_type_text(f['type'])}" for f in value.get("fields", []))
        return f"struct<{inner}>" if value.get("type") == "struct" else str(value.get("type"))
    return str(value)


def _shown(fields: list[dict[str, Any]]) -> str:
    return ", ".join(f"{f['name']}:{_type_text(f['type'])}" for f in fields) or "nothing"


def saved_operators(stage: dict[str, Any]) -> list[dict[str, Any]]:
    """A savepoint stage's operators in the plan's terms: its recorded plan, with the state files' schemas."""
    from_state = [{"kind": OPERATOR_KINDS.get(op.get("operator_name", ""), op.get("operator_name", "unknown")),
                   "keys": _fields(op.get("key_schema")), "value": _fields(op.get("value_schema"))}
                  for op in sorted(stage.get("operators") or [], key=lambda op: op["operator_id"])]
    planned = [_normalized(op) for op in (stage.get("plan") or {}).get("operators") or []]
    if len(planned) != len(from_state):
        return from_state if from_state or not planned else planned
    return [{**plan_op, **{k: v for k, v in state_op.items() if k in ("keys", "value") and v}}
            if plan_op["kind"] in WINDOWED or plan_op["kind"].startswith("dedup") else plan_op
            for plan_op, state_op in zip(planned, from_state, strict=True)]


def _signature(operators: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    return [(op["kind"], *(f["name"] for f in op.get("keys", [])), "|", *(f["name"] for f in op.get("value", [])))
            for op in operators]


def _compare_keyed(report: Report, stage: str, index: int, old: dict[str, Any], new: dict[str, Any],
                   names_rule: str) -> None:
    old_names, new_names = [f["name"] for f in old["keys"]], [f["name"] for f in new["keys"]]
    if old_names != new_names:
        report.add(names_rule, stage, f"key was {_shown(old['keys'])}, now {_shown(new['keys'])}", index)
    elif old["keys"] != new["keys"]:
        report.add("CO-KEY-02", stage, f"key was {_shown(old['keys'])}, now {_shown(new['keys'])}", index)


def _compare_operator(report: Report, stage: str, index: int, old: dict[str, Any], new: dict[str, Any]) -> None:
    kinds = {old["kind"], new["kind"]}
    if old["kind"] != new["kind"]:
        rule = "CO-WIN-02" if kinds <= WINDOWED else "CO-OPS-02"
        report.add(rule, stage, f"was {old['kind']}, now {new['kind']}", index)
        return
    kind = new["kind"]
    if kind in WINDOWED:
        _compare_keyed(report, stage, index, old, new, "CO-KEY-01")
        old_functions = [a["function"] for a in old.get("aggregates", [])]
        new_functions = [a["function"] for a in new.get("aggregates", [])]
        value_names = ([f["name"] for f in old.get("value", [])], [f["name"] for f in new.get("value", [])])
        if (old_functions and old_functions != new_functions) or (
                old.get("value") and value_names[0] != value_names[1]):
            was = ", ".join(old_functions) or _shown(old.get("value", []))
            report.add("CO-AGG-01", stage, f"accumulators were {was}, now {', '.join(new_functions)} "
                                           f"(state value {_shown(new.get('value', []))})", index)
        elif old.get("value") and old["value"] != new.get("value"):
            report.add("CO-VAL-01", stage, f"state value was {_shown(old['value'])}, now {_shown(new['value'])}",
                       index)
        old_window, new_window = old.get("window"), new.get("window")
        if old_window and new_window and old_window != new_window:
            if old_window["kind"] != new_window["kind"] and "session" in (old_window["kind"], new_window["kind"]):
                report.add("CO-WIN-02", stage, f"was a {old_window['kind']} window, now {new_window['kind']}", index)
            else:
                report.add("CO-WIN-01", stage, f"window was {_window_text(old_window)}, "
                                               f"now {_window_text(new_window)}", index)
    elif kind.startswith("dedup"):
        _compare_keyed(report, stage, index, old, new, "CO-DEDUP-01")
    elif kind == "join" and "join_type" in old:
        if (old["join_type"], old["condition"]) != (new["join_type"], new["condition"]):
            report.add("CO-JOIN-01", stage, f"was {old['join_type']} on {old['condition']}, "
                                            f"now {new['join_type']} on {new['condition']}", index)
    elif kind == "flat_map_groups_with_state" and "state_schema" in old:
        if old["state_schema"] != new.get("state_schema"):
            report.add("CO-GWS-01", stage, f"state was {old['state_schema']}, now {new.get('state_schema')}", index)
    elif kind == "transform_with_state" and "state_schema" in old and old["state_schema"] != new.get("state_schema"):
        report.add("CO-TWS-01", stage, f"state was {old['state_schema']}, now {new.get('state_schema')}", index)


def _window_text(window: dict[str, Any]) -> str:
    if window["kind"] == "session":
        return f"session with gap {window['gap']}"
    return f"{window['kind']} {window['duration']}" + (f" sliding {window['slide']}" if window["kind"] == "sliding"
                                                       else "")


def _compare_stage(report: Report, stage: str, saved: dict[str, Any], new: dict[str, Any]) -> None:
    old_ops, new_ops = saved_operators(saved), [_normalized(op) for op in new["operators"]]
    if len(old_ops) != len(new_ops):
        report.add("CO-OPS-01", stage, f"{len(old_ops)} stateful operator(s) "
                                       f"({', '.join(o['kind'] for o in old_ops) or 'none'}), now {len(new_ops)} "
                                       f"({', '.join(o['kind'] for o in new_ops) or 'none'})")
    else:
        for index, (old, current) in enumerate(zip(old_ops, new_ops, strict=True)):
            _compare_operator(report, stage, index, old, current)
    plan = saved.get("plan")
    if not plan:
        report.add("CO-PLAN-01", stage, "the savepoint records state schemas only, no plan")
        return
    old_formats, new_formats = [s["format"] for s in plan["sources"]], [s["format"] for s in new["sources"]]
    if old_formats != new_formats:
        report.add("CO-SRC-01", stage, f"sources were {old_formats}, now {new_formats}")
    elif plan["sources"] != new["sources"]:
        report.add("CO-SRC-02", stage, f"options were {[s['options'] for s in plan['sources']]}, "
                                       f"now {[s['options'] for s in new['sources']]}")
    if plan["sink"] != new["sink"]:
        report.add("CO-SINK-01", stage, f"was {plan['sink']}, now {new['sink']}")
    if plan["output_mode"] != new["output_mode"]:
        report.add("CO-MODE-01", stage, f"was {plan['output_mode']}, now {new['output_mode']}")
    if [w["delay"] for w in plan["watermarks"]] != [w["delay"] for w in new["watermarks"]]:
        report.add("CO-WM-01", stage, f"was {plan['watermarks']}, now {new['watermarks']}")
    if old_ops and plan["shuffle_partitions"] != new["shuffle_partitions"]:
        report.add("CO-CONF-01", stage, f"was {plan['shuffle_partitions']}, now {new['shuffle_partitions']}; "
                                        f"the stage keeps {plan['shuffle_partitions']}")


def check(job: str, savepoint: str, saved_stages: dict[str, dict[str, Any]], new_stages: dict[str, dict[str, Any]],
          renames: dict[str, str] | None = None, strict: bool = False) -> Report:
    """Every stage of the savepoint against the new code's stages, under the stage rules of a job update.
    Strict mode (Flink's disableAutoGeneratedUIDs) also refuses stage names that look generated rather than chosen."""
    report = Report(job, savepoint)
    renames = dict(renames or {})
    if strict:
        for name in new_stages:
            if GENERATED_NAME.fullmatch(name):
                report.add("CO-STRICT-01", name, f"{name!r} looks like a position or an id, which shifts when "
                                                 "stages are added or reordered")
    for old, new in renames.items():
        if old not in saved_stages or new not in new_stages:
            report.add("CO-STAGE-06", old, f"{old}={new}: the savepoint has {sorted(saved_stages)}, "
                                           f"the new code {sorted(new_stages)}")
    pairs = {old: new for old, new in renames.items() if old in saved_stages and new in new_stages}
    pairs.update({name: name for name in saved_stages if name in new_stages and name not in pairs
                  and name not in pairs.values()})
    unmatched_new = [name for name in new_stages if name not in pairs.values()]
    for old, saved in saved_stages.items():
        stateful = bool(saved_operators(saved))
        if old in pairs:
            if pairs[old] != old:
                report.add("CO-STAGE-05", pairs[old], f"state of {old} moves to {pairs[old]}")
            _compare_stage(report, pairs[old], saved, new_stages[pairs[old]])
        elif not stateful:
            report.add("CO-STAGE-01", old, "removed")
        else:
            twins = [n for n in unmatched_new if _signature(new_stages[n]["operators"]) == _signature(
                saved_operators(saved)) and new_stages[n]["operators"]]
            if twins:
                report.add("CO-STAGE-04", old, f"{old} is gone and {twins[0]} has the same stateful operators; "
                                               f"use --rename-stage {old}={twins[0]}")
                unmatched_new.remove(twins[0])
            else:
                kinds = ", ".join(o["kind"] for o in saved_operators(saved))
                report.add("CO-STAGE-03", old, f"state of {old} ({kinds}) would be dropped")
    for name in unmatched_new:
        report.add("CO-STAGE-02" if new_stages[name]["operators"] else "CO-STAGE-01", name, "added")
    return report
