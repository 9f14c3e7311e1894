"""The compatibility check on a real job and its variants: a base checkpoint written by Spark, the variants'
plans read from Spark's analysed plans, and one expected verdict and rule per change (issue 8's matrix).

The base job runs for real (one availableNow pass of each stage), so the state schemas the checker reads are
the ones Spark wrote. `changeover check` is also run as a user runs it, inside the 4.2.0 runtime.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from changeover import savepoints
from changeover.compat.checker import check
from changeover.compat.rules import Verdict
from changeover.registry.db import session_scope
from changeover.registry.models import Job, JobRun
from changeover.registry.schema import migrate
from changeover.runtime.checkpoints import stateful_operators
from changeover.runtime.contract import JobContext, unmatched_state
from changeover.runtime.plan import describe_stages
from changeover.settings import Settings

pytestmark = pytest.mark.slow
VARIANTS = Path(__file__).parent / "compat_jobs" / "variants.py"
sys.path.insert(0, str(VARIANTS.parent))
import variants  # noqa: E402 - the job file, imported as the driver imports it


@dataclass
class Base:
    spark: Any
    folder: Path
    checkpoints: Path
    saved: dict[str, dict[str, Any]]  # stage -> manifest entry: operators from the state files, and the plan
    rows: dict[str, list[tuple[Any, ...]]]  # stage -> what the base job emitted


def _write_events(folder: Path, part: int = 0) -> None:
    """Part 0 is the base job's input; part 1 arrives after the change: every key again, and a late clock
    that closes every window."""
    (folder / "events").mkdir(parents=True, exist_ok=True)
    (folder / "more-events").mkdir(exist_ok=True)  # the input of the variant that adds a source
    rows = [{"key": f"user-{i % 3}", "ts": f"2026-01-01T00:{part:02d}:{i:02d}Z", "v": i, "k2": i % 2}
            for i in range(12)]
    (folder / "events" / f"part-{part}.json").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def plans_of(spark: Any, folder: Path, variant: str) -> dict[str, dict[str, Any]]:
    stages = variants.build(spark, JobContext("matrix", 0, {"input": str(folder), "variant": variant}))
    return describe_stages(spark, stages)


def run_stage(stage: Any, checkpoint: Path) -> list[tuple[Any, ...]]:
    """Every row the stage emits until its input is used up, as a user's foreachBatch would see them."""
    rows: list[tuple[Any, ...]] = []

    def collect(frame: Any, batch_id: int) -> None:
        rows.extend(tuple(row) for row in frame.collect())

    query = (stage.frame.writeStream.foreachBatch(collect).outputMode(stage.output_mode)
             .option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start())
    query.awaitTermination(300)  # raises the query's own error
    return rows


def outcome(mode: str, rows: list[tuple[Any, ...]]) -> Any:
    """What a reader of the sink ends with: the latest value per key in update mode, every row in append."""
    return {row[:-1]: row[-1] for row in rows} if mode == "update" else sorted(rows, key=repr)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Base]:
    from changeover.savepoints import describe_operators
    from pyspark.sql import SparkSession

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    spark = (SparkSession.builder.master("local[1]").appName("compat-matrix").config("spark.ui.enabled", "false")
             .config("spark.sql.shuffle.partitions", "2").config("spark.sql.session.timeZone", "UTC").getOrCreate())
    folder = tmp_path_factory.mktemp("matrix")
    _write_events(folder)
    checkpoints = folder / "checkpoints"
    stages = variants.build(spark, JobContext("matrix", 0, {"input": str(folder)}))
    rows = {stage.name: run_stage(stage, checkpoints / stage.name) for stage in stages}  # the base job's batch
    plans = describe_stages(spark, stages)
    saved = {name: {"operators": describe_operators(None, stateful_operators(checkpoints / name)),
                     "plan": plans[name]} for name in plans}
    yield Base(spark, folder, checkpoints, saved, rows)
    spark.stop()


def test_the_base_checkpoint_holds_what_spark_wrote(base: Base) -> None:
    kinds = {name: [op["operator_name"] for op in entry["operators"]] for name, entry in base.saved.items()}
    assert kinds == {"totals": ["stateStoreSave"], "windows": ["stateStoreSave"], "cleaned": [],
                     "unique": ["dedupe"]}
    (totals,) = base.saved["totals"]["operators"]
    assert [f["name"] for f in totals["value_schema"]["fields"]] == ["count"]
    assert base.saved["windows"]["plan"]["operators"][0]["window"] == {
        "kind": "sliding", "column": "ts", "duration": "10 seconds", "slide": "5 seconds"}


MATRIX = [  # variant, rename map, verdict, rules
    ("base", {}, Verdict.COMPATIBLE, set()),
    ("filter_added", {}, Verdict.COMPATIBLE, set()),
    ("map_renamed", {}, Verdict.COMPATIBLE, set()),
    ("stateful_stage_added", {}, Verdict.COMPATIBLE, {"CO-STAGE-02"}),
    ("stage_removed", {}, Verdict.NEEDS_DISCARD, {"CO-STAGE-03"}),
    ("stage_renamed", {}, Verdict.INCOMPATIBLE, {"CO-STAGE-04"}),
    ("stage_renamed", {"totals": "running_totals"}, Verdict.COMPATIBLE, {"CO-STAGE-05"}),
    ("count_to_sum", {}, Verdict.INCOMPATIBLE, {"CO-AGG-01"}),
    ("key_type", {}, Verdict.INCOMPATIBLE, {"CO-KEY-02"}),
    ("window_size", {}, Verdict.COMPATIBLE_WITH_WARNING, {"CO-WIN-01"}),
    ("session_window", {}, Verdict.INCOMPATIBLE, {"CO-WIN-02"}),
    ("dedup_columns", {}, Verdict.INCOMPATIBLE, {"CO-DEDUP-01"}),
    ("source_added", {}, Verdict.INCOMPATIBLE, {"CO-SRC-01"}),
]


@pytest.mark.parametrize(("variant", "renames", "verdict", "rules"), MATRIX,
                         ids=[f"{v}{'-mapped' if r else ''}" for v, r, _, _ in MATRIX])
def test_each_change_gets_its_verdict_and_rule(base: Base, variant: str, renames: dict[str, str],
                                               verdict: Verdict, rules: set[str]) -> None:
    report = check("matrix", "matrix/base", base.saved, plans_of(base.spark, base.folder, variant), renames)
    assert ({f.rule for f in report.findings}, report.verdict) == (rules, verdict), report.render()
    for finding in report.findings:
        if finding.verdict == Verdict.INCOMPATIBLE:  # a newcomer reads where, what and how to fix it
            assert f"job matrix, stage {finding.stage}" in finding.line() and "Fix: " in finding.line()


def test_changed_shuffle_partitions_warn_that_the_checkpoint_keeps_its_own(base: Base) -> None:
    session = base.spark.newSession()
    session.conf.set("spark.sql.shuffle.partitions", "7")
    report = check("matrix", "matrix/base", base.saved, plans_of(session, base.folder, "base"))
    assert {(f.rule, f.stage) for f in report.findings} == {
        ("CO-CONF-01", stage) for stage in ("totals", "windows", "unique")}
    assert report.verdict == Verdict.COMPATIBLE_WITH_WARNING


@pytest.fixture(scope="module")
def registry(base: Base, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    """A registry with job `matrix` (the variant count_to_sum as its new code's options) whose run is the base
    job's checkpoint, and its savepoint `before-update`."""
    home = tmp_path_factory.mktemp("registry")
    url = f"sqlite:///{home / 'registry.db'}"
    migrate(url)
    settings = Settings.from_env(home=home / "home", database_url=url)
    with session_scope(url) as s:
        s.add(Job(name="matrix", module="variants", fault_tolerant=True, block_shutdown=False,
                  options={"input": str(base.folder), "variant": "count_to_sum",
                           "spark": {"shuffle_partitions": 2}}))  # as the base ran: no CO-CONF-01
        s.flush()
        run = JobRun(job="matrix", spark_version="4.2.0", master_url="spark://x", state="RUNNING",
                     checkpoint_root=str(base.checkpoints), progress={},
                     plans={name: entry["plan"] for name, entry in base.saved.items()})
        s.add(run)
        s.flush()
        s.get(Job, "matrix").current_run_id = run.id
    savepoints.take(settings, "matrix", "before-update", mode="continue")
    return settings


def test_changeover_check_runs_in_the_runtime_and_exits_with_the_verdict(registry: Settings) -> None:
    env = {**os.environ, **registry.as_env()}
    command = [sys.executable, "-m", "changeover", "check", str(VARIANTS), "--savepoint", "matrix/before-update"]
    result = subprocess.run([*command, "--json"], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == int(Verdict.INCOMPATIBLE), result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert (report["verdict"], report["stages"]["totals"]) == ("INCOMPATIBLE", "INCOMPATIBLE")
    assert [f["rule"] for f in report["findings"]] == ["CO-AGG-01"]
    shown = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300).stdout
    assert "CO-AGG-01 job matrix, stage totals, operator 0" in shown and "accumulators were count, now sum" in shown


MISSPELT = """
from changeover.runtime import Files, Stage


def build(spark, ctx):
    events = spark.readStream.schema("key STRING, ts TIMESTAMP").json(ctx.options["input"] + "/events")
    return [Stage("totals", events.groupBy("kee").count(), Files(ctx.options["input"] + "/broken", "json"))]
"""


def test_code_that_does_not_build_is_one_plain_line_and_exit_2(registry: Settings, tmp_path: Path) -> None:
    """Spark's analysis error holds brackets ([UNRESOLVED_COLUMN...], [`key`, `ts`]): printed as they are, never
    read as Rich markup (which crashed the CLI with a traceback)."""
    broken = tmp_path / "misspelt.py"
    broken.write_text(MISSPELT)
    result = subprocess.run([sys.executable, "-m", "changeover", "check", str(broken), "--savepoint",
                             "matrix/before-update"], env={**os.environ, **registry.as_env(), "COLUMNS": "400"},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and "UNRESOLVED_COLUMN" in line and "`kee`" in line, line


def _files(folder: Path) -> dict[str, tuple[int, int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_ino, p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file()}


def test_the_dry_run_replays_a_saved_batch_on_the_runtime_and_touches_nothing(base: Base,
                                                                              registry: Settings) -> None:
    """Spark 4.2.0 itself refuses count -> sum when the batch is replayed; the compatible code replays each
    stateful stage's last saved batch with its rows. The live checkpoint and the savepoint are left as they
    were, and the scratch copies are gone."""
    from changeover.compat.static_check import check_code

    with session_scope(registry.database_url) as s:
        saved = Path(savepoints.get_savepoint(s, "matrix", "before-update").path)
    before = (_files(base.checkpoints), _files(saved))
    env = {**os.environ, **registry.as_env()}
    result = subprocess.run([sys.executable, "-m", "changeover", "check", str(VARIANTS), "--savepoint",
                             "matrix/before-update", "--dry-run", "--json"],
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == int(Verdict.INCOMPATIBLE), result.stderr[-2000:]
    report = json.loads(result.stdout)
    found = {(f["rule"], f["stage"]) for f in report["findings"]}
    assert found == {("CO-AGG-01", "totals"), ("CO-VAL-01", "totals")}, report
    (spark_said,) = [f["detail"] for f in report["findings"] if f["rule"] == "CO-VAL-01"]
    assert "STATE_STORE_VALUE_SCHEMA_NOT_COMPATIBLE" in spark_said and "refused batch 0" in spark_said

    compatible = check_code(registry, str(VARIANTS), "matrix/before-update", options={"variant": "filter_added"},
                            dry_run=True)
    assert compatible.verdict == Verdict.COMPATIBLE, compatible.render()
    replayed = compatible.dry_run or {}
    assert set(replayed) == {"totals", "windows", "unique", "cleaned"}, replayed  # every stage that committed
    assert replayed["totals"] == {"batch": 0, "input_rows": 12, "batches": [0]}, replayed
    # windows' last batch was a no-data batch after batch 0: replayed from state version 1, and nothing after it
    assert replayed["windows"] == {"batch": 1, "input_rows": 0, "batches": [1]}, replayed
    assert "dry run: stage totals replayed batch 0 (12 input rows)" in compatible.render()
    assert (_files(base.checkpoints), _files(saved)) == before
    assert not any((registry.home / "scratch").iterdir())


def test_strict_mode_refuses_generated_stage_names(base: Base) -> None:
    plans = plans_of(base.spark, base.folder, "base")
    renamed = {"stage_0" if name == "cleaned" else name: plan for name, plan in plans.items()}
    assert check("matrix", "matrix/base", base.saved, renamed).verdict == Verdict.COMPATIBLE
    report = check("matrix", "matrix/base", base.saved, renamed, strict=True)
    assert [(f.rule, f.stage) for f in report.findings if f.verdict == Verdict.INCOMPATIBLE] == [
        ("CO-STRICT-01", "stage_0")], report.render()


CONFIRMED = [(variant, renames) for variant, renames, verdict, _ in MATRIX
             if verdict == Verdict.INCOMPATIBLE or variant in ("filter_added", "stage_renamed")]


@pytest.mark.parametrize(("variant", "renames"), CONFIRMED,
                         ids=[f"{v}{'-mapped' if r else ''}" for v, r in CONFIRMED])
def test_the_verdict_is_what_spark_really_does_on_a_scratch_copy(base: Base, tmp_path: Path, variant: str,
                                                                 renames: dict[str, str]) -> None:
    """INCOMPATIBLE: the restored stage fails, or ends with other results than the new code run from scratch
    over the same input. COMPATIBLE (the controls): the same results. The base's checkpoints are copied."""
    import shutil

    if not (base.folder / "events" / "part-1.json").exists():
        _write_events(base.folder, part=1)  # input after the change; the base rows stand before it
    report = check("matrix", "matrix/base", base.saved, plans_of(base.spark, base.folder, variant), renames)
    stages = {s.name: s for s in variants.build(base.spark, JobContext("matrix", 0, {
        "input": str(base.folder), "variant": variant}))}
    flagged = {f.stage for f in report.findings if f.verdict == Verdict.INCOMPATIBLE}
    new_of = {**{name: name for name in stages}, **renames, **(
        {"totals": "running_totals"} if variant == "stage_renamed" else {})}
    for old in sorted(flagged) or [next(iter(renames), "totals")]:
        new = new_of[old]
        if {f.rule for f in report.findings if f.stage == old} == {"CO-STAGE-04"}:
            # Spark alone would start the renamed stage empty and re-read its files from the start; the driver
            # refuses first, because state of a stage the code no longer has is never dropped silently.
            assert unmatched_state("matrix", set(base.saved), set(stages)) is not None
            continue
        scratch = tmp_path / "restored" / new
        if old in renames or old == new:  # with a rename map the state moves; without one the stage starts empty
            shutil.copytree(base.checkpoints / old, scratch)
        mode = stages[new].output_mode
        try:
            restored = outcome(mode, base.rows[old] + run_stage(stages[new], scratch))
        except Exception as error:  # noqa: BLE001 - any refusal by Spark confirms the verdict
            assert flagged, f"{variant}: a compatible change failed on restore: {error}"
            print(f"{variant}: Spark refused the restore: {str(error).splitlines()[0][:160]}")
            continue
        fresh = outcome(mode, run_stage(stages[new], tmp_path / "fresh" / new))
        if flagged:
            assert restored != fresh, f"{variant}: stage {new} restored the right results after all"
            print(f"{variant}: Spark restored stage {new} with wrong results")
        else:
            assert restored == fresh, f"{variant}: a compatible change restored other results"
