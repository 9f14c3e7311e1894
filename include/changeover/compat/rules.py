"""The rule catalogue: each rule has a stable id, the verdict it gives, and the fix it suggests.

The rules translate a job update's supported and unsupported changes and the rule that state types may not
change to Spark,
with Spark's own "Recovery Semantics after Changes in a Streaming Query" on top. Ids never change meaning;
a retired rule keeps its id unused.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class Verdict(IntEnum):
    """Ordered by severity; the worst finding is the report's verdict. The value is the CLI's exit code."""

    COMPATIBLE = 0
    COMPATIBLE_WITH_WARNING = 10
    NEEDS_DISCARD = 20
    INCOMPATIBLE = 30


@dataclass(frozen=True)
class Rule:
    id: str
    verdict: Verdict
    title: str
    fix: str


def _rules(*rules: Rule) -> dict[str, Rule]:
    return {rule.id: rule for rule in rules}


C, W, D, X = Verdict.COMPATIBLE, Verdict.COMPATIBLE_WITH_WARNING, Verdict.NEEDS_DISCARD, Verdict.INCOMPATIBLE
RULES = _rules(
    Rule("CO-STAGE-01", C, "a stateless stage was added or removed", "nothing to do"),
    Rule("CO-STAGE-02", C, "a new stateful stage starts with empty state", "nothing to do"),
    Rule("CO-STAGE-03", D, "the savepoint holds state of a stage the new code no longer has",
         "resume with --allow-non-restored-state to drop that state, or keep the stage"),
    Rule("CO-STAGE-04", X, "a stateful stage looks renamed: its state would be dropped and the new stage start empty",
         "resume with --rename-stage OLD=NEW to move the state, or keep the old name"),
    Rule("CO-STAGE-05", C, "a stage's state moves to its new name (--rename-stage)", "nothing to do"),
    Rule("CO-STAGE-06", X, "a rename names a stage the savepoint or the new code does not have",
         "pass --rename-stage OLD=NEW with OLD a stage of the savepoint and NEW a stage of the new code"),
    Rule("CO-OPS-01", X, "stateful operators were added to or removed from a stage; Spark numbers them by position",
         "put the new stateful step in a new stage, which starts empty, and keep the old stage's operators"),
    Rule("CO-OPS-02", X, "a stateful operator was replaced by one of another kind",
         "keep the operator, or move the new one into a new stage that starts empty"),
    Rule("CO-AGG-01", X, "an aggregation's accumulator changed (e.g. count to sum): the state holds other values",
         "keep the aggregate functions and add the new one in a new stage; Spark 4.3 would restore it silently "
         "with wrong results"),
    Rule("CO-KEY-01", X, "the state's key changed: grouping or key columns differ",
         "keep the grouping columns, or compute the new grouping in a new stage"),
    Rule("CO-KEY-02", X, "the type of a key column changed (state types may not change)",
         "cast the column back to its old type before the stateful operator"),
    Rule("CO-VAL-01", X, "the type of a state value changed (state types may not change)",
         "cast the aggregated column back to its old type"),
    Rule("CO-WIN-01", W, "the window's size or slide changed",
         "nothing required; during a transition period, windows opened before the change close with their "
         "old boundaries and counts, and windows opened after it use the new ones"),
    Rule("CO-WIN-02", X, "the window kind changed (e.g. sliding to session): the state is keyed differently",
         "keep the window kind, or compute the new windows in a new stage"),
    Rule("CO-WM-01", W, "the watermark's delay changed",
         "nothing required; late events are judged by the new delay from the first batch on"),
    Rule("CO-DEDUP-01", X, "the deduplication columns changed", "keep the columns, or deduplicate in a new stage"),
    Rule("CO-JOIN-01", X, "the join type or its equi-join columns changed",
         "keep the join as it was, or join in a new stage"),
    Rule("CO-GWS-01", X, "the state schema of a *GroupsWithState operator changed",
         "keep the state type, or move the function into a new stage"),
    Rule("CO-TWS-01", W, "a transformWithState operator changed: only its schema evolution rules allow it",
         "check the change against transformWithState's schema evolution rules (Avro encoding, added fields)"),
    Rule("CO-SRC-01", X, "the number or type of a stage's sources changed",
         "keep the stage's sources, or read the new source in a new stage"),
    Rule("CO-SRC-02", W, "a source's options changed", "check the source's documentation: some options (e.g. a "
         "file source's path) change which input counts as already read"),
    Rule("CO-SINK-01", W, "the sink changed", "a new sink has no record of the batches the old one wrote: "
         "expect the next batch in it, not the history"),
    Rule("CO-MODE-01", W, "the output mode changed", "check that the sink and the operators support the new mode"),
    Rule("CO-PLAN-01", W, "the savepoint predates plan recording: windows, joins, sources and sinks went unchecked",
         "take a new savepoint of the running job and check against it"),
    Rule("CO-VER-01", X, "the target Spark version cannot resume state the savepoint's version wrote (measured)",
         "resume on the savepoint's version, or on one the version table (docs/compatibility.md) marks yes"),
    Rule("CO-VER-02", W, "this pair of Spark versions is not in the measured version table",
         "measure it: python -m changeover.compat.version_table"),
    Rule("CO-CONF-01", W, "spark.sql.shuffle.partitions changed",
         "nothing required: a restored stateful stage keeps its checkpoint's partitions; the new value applies "
         "to new stages only"),
    Rule("CO-DRY-01", X, "the new code failed on a batch replayed from a copy of the savepoint (dry run)",
         "read Spark's error above, fix the code or pick another target version, and check again; the running "
         "job was not touched"),
    Rule("CO-DRY-02", W, "the dry run replayed no batch of the stage within its deadline",
         "check again with a longer --dry-run-timeout on a less busy machine; the static check still stands"),
    Rule("CO-SCALE-01", X, "the stage's state is in the HDFS-backed store, which Spark cannot repartition",
         "resume without a new partition count; a job that may need to grow starts on RocksDB: submit it anew with "
         "the job option state_store: rocksdb (its first run pins the store for good)"),
    Rule("CO-SCALE-02", X, "the target Spark version cannot repartition state (the version table's repartition row)",
         "resume on a version the version table marks yes for repartitioning (4.2.0 or later), or without a new "
         "partition count"),
    Rule("CO-SCALE-03", X, "Spark refused to repartition the stage's state on a copy of the savepoint (dry run)",
         "resume without a new partition count: Spark's error above names the operator or state it cannot "
         "repartition; the running job was not touched"),
    Rule("CO-SCALE-04", C, "the stage's state moves to a new number of partitions", "nothing to do"),
    Rule("CO-STRICT-01", X, "strict mode: the stage's name looks generated, not chosen",
         "give the stage an explicit, stable name in build(): its state is found by that name"),
)
