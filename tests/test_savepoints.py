"""Savepoints on real Spark: continue and stop modes, kill -9, corruption, older savepoints, stage names.

One live `clicks` job per registry database runs through the whole module, fed by the generator.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from changeover import jobs, savepoints
from changeover.cli.generator import Generator
from changeover.cluster import LocalCluster, wait_for
from changeover.cluster.runtimes import find_runtime, java_home
from changeover.errors import ChangeoverError
from changeover.registry.db import session_scope
from changeover.registry.models import JobRun, Savepoint, SinkLedger
from changeover.settings import Settings
from conftest import ONE_REGISTRY, TRIGGER, registry_settings
from jobs import clicks
from sqlalchemy import func, select

pytestmark = pytest.mark.slow


@dataclass
class Live:
    settings: Settings
    cluster: LocalCluster
    generator: Generator

    def launch(self, job: str, savepoint: str | None = None, **options: Any) -> JobRun:
        submit = {k: options.pop(k) for k in ("rename_stages", "allow_non_restored_state", "rewind_sink")
                  if k in options}
        return jobs.submit(self.settings, self.cluster, "jobs.clicks", job,
                           options={"landing": str(self.generator.landing), "trigger": TRIGGER, **options},
                           from_savepoint=savepoint, **submit)

    def batch(self, job: str, stage: str = "totals") -> int:
        run = jobs.refresh(self.settings, self.cluster, job)
        assert run is not None
        return run.progress.get(stage) or -1

    def wait_batches(self, job: str, more: int) -> int:
        target = self.batch(job) + more
        wait_for(lambda: self.batch(job) >= target, 180, f"{job} committing {more} more batches")
        return self.batch(job)

    def settle(self, job: str) -> dict[str, int]:
        """Pause the input, wait until the job's totals equal the ground truth, resume the input."""
        self.generator.pause()
        try:
            truth = dict(self.generator.truth)
            wait_for(lambda: clicks.results(self.settings.database_url, job)[0] == truth, 240,
                     f"{job}'s totals catching up with the ground truth")
            return truth
        finally:
            self.generator.resume()

    def first_sink_batch(self, job: str, stage: str) -> int | None:
        with session_scope(self.settings.database_url) as s:
            return s.scalar(select(func.min(SinkLedger.batch_id)).where(SinkLedger.job == job,
                                                                        SinkLedger.stage == stage))

    def first_batches(self, job: str, stages: list[str]) -> dict[str, int]:
        """The first batch each stage's sink wrote, once every stage has written one (they run apart)."""
        wait_for(lambda: all(self.first_sink_batch(job, st) is not None for st in stages), 180,
                 f"every stage of {job} writing a batch")
        return {st: self.first_sink_batch(job, st) for st in stages}  # type: ignore[misc]

    def stop(self, job: str) -> None:
        jobs.cancel(self.settings, self.cluster, job, reason="test finished with it")


STATE_AT_BATCH = """
import json, sys
from pyspark.sql import SparkSession
spark = SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false").getOrCreate()
spark.streams.active  # creates the StateStoreCoordinator that the reader asks for
rows = spark.read.format("statestore").option("batchId", int(sys.argv[2])).load(sys.argv[1]).collect()
print("STATE " + json.dumps({row["key"]["key"]: row["value"]["count"] for row in rows}))
"""


def state_at_batch(settings: Settings, stage_checkpoint: Path, batch: int) -> dict[str, int]:
    """Per-key counts held in a stage checkpoint at a batch, read with Spark's `statestore` reader."""
    runtime = find_runtime(settings.runtimes_dir, "4.2.0")
    result = subprocess.run([str(runtime.python), "-c", STATE_AT_BATCH, str(stage_checkpoint), str(batch)],
                            env={**os.environ, "JAVA_HOME": str(java_home()), "SPARK_LOCAL_IP": "127.0.0.1"},
                            capture_output=True, text=True, timeout=300)
    lines = [line for line in result.stdout.splitlines() if line.startswith("STATE ")]
    assert lines, result.stderr[-3000:]
    return json.loads(lines[0].removeprefix("STATE "))


def counts_of_processed_files(stage_checkpoint: Path, batch: int) -> dict[str, int]:
    """Per-key event counts of the input files the checkpoint's file-source log says batches up to `batch` read
    (the savepoint also keeps the entry of the batch planned next, which is replayed, not yet processed)."""
    paths = set()
    for log in (stage_checkpoint / "sources" / "0").iterdir():
        if log.name.startswith("."):
            continue
        for line in log.read_text().splitlines()[1:]:
            entry = json.loads(line)
            if entry["batchId"] <= batch:
                paths.add(entry["path"].removeprefix("file://"))
    counts: Counter[str] = Counter()
    for path in paths:
        counts.update(json.loads(line)["key"] for line in Path(path).read_text().splitlines())
    return dict(counts)


@pytest.fixture(scope="module", params=ONE_REGISTRY)
def live(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, pg_database) -> Iterator[Live]:
    home = tmp_path_factory.mktemp(f"savepoints-{request.param}")
    settings = registry_settings(request.param, home, pg_database, "changeover_sp")
    cluster = LocalCluster(settings)
    generator = Generator(settings.data_dir / "landing")
    try:
        cluster.up([("m1", "4.2.0"), ("m2", "4.2.0")])
        generator.write_file()
        generator.start(interval=0.5)
        state = Live(settings, cluster, generator)
        state.launch("clicks")
        jobs.wait_until_committed(settings, cluster, "clicks")
        yield state
    finally:
        generator.stop()
        cluster.down()


def test_continue_savepoint_resumes_at_its_batch_and_costs_the_running_job_nothing(live: Live) -> None:
    live.wait_batches("clicks", 2)
    sp = savepoints.take(live.settings, "clicks", "c1", mode="continue")
    assert sp.mode == "continue" and set(sp.stages) == {"totals", "windows"}
    assert jobs.refresh(live.settings, live.cluster, "clicks").state == "RUNNING"
    manifest = savepoints.verify(Path(sp.path))
    assert manifest["code_fingerprint"] and manifest["stages"]["totals"]["batch"] == sp.stages["totals"]
    (totals,) = manifest["stages"]["totals"]["operators"]
    assert (totals["read_by"], totals["operator_name"], totals["state_stores"]) == (
        "state-metadata", "stateStoreSave", ["default"])
    assert [f["name"] for f in totals["key_schema"]["fields"]] == ["key"]
    assert [f["name"] for f in totals["value_schema"]["fields"]] == ["count"]
    # and the stage's plan as the driver read it, for `changeover check`
    (planned,) = manifest["stages"]["totals"]["plan"]["operators"]
    assert (planned["kind"], [a["function"] for a in planned["aggregates"]]) == ("aggregation", ["count"])
    assert manifest["stages"]["windows"]["plan"]["operators"][0]["window"]["duration"] == "10 seconds"
    # The savepoint's state at its batch is the original's result at that batch: every event of the
    # files processed up to that batch, per key.
    stage = Path(sp.path) / "stages" / "totals"
    assert state_at_batch(live.settings, stage, sp.stages["totals"]) == counts_of_processed_files(
        stage, sp.stages["totals"])
    live.wait_batches("clicks", 1)

    live.launch("replay", savepoint="clicks/c1")
    jobs.wait_until_committed(live.settings, live.cluster, "replay")
    # The copy stands exactly at the savepoint's batches: the replay writes the next ones first.
    assert live.first_batches("replay", list(sp.stages)) == {st: batch + 1 for st, batch in sp.stages.items()}
    live.settle("replay")  # savepoint state + the replayed input = every key's exact total
    live.settle("clicks")  # and the original lost nothing because of the savepoint
    live.stop("replay")


def test_kill_9_at_any_point_leaves_a_complete_savepoint_or_none(live: Live) -> None:
    code = ("from changeover.settings import Settings; from changeover import savepoints; "
            "savepoints.take(Settings.from_env(), 'clicks', 'crashy', mode='continue')")
    env = {**os.environ, **live.settings.as_env(), "CHANGEOVER_FAULTS": "1"}
    for point in ("pending", "copying", "copied", "manifest", "moved"):
        result = subprocess.run([sys.executable, "-c", code], env={**env, "CHANGEOVER_CRASH_AT": point})
        assert result.returncode == -9, point
        with session_scope(live.settings.database_url) as s:
            assert s.scalar(select(Savepoint).where(Savepoint.status == "COMPLETED",
                                                    Savepoint.name == "crashy")) is None, point
        with pytest.raises(ChangeoverError, match="no such savepoint"):
            savepoints.restore(live.settings, "clicks", "crashy")
        removed = savepoints.reconcile(live.settings)
        assert removed["rows"] == ["clicks/crashy"], point
        assert not (live.settings.savepoint_dir / "clicks" / "crashy").exists()
        assert not list((live.settings.savepoint_dir / "clicks").glob(".staging-*"))
    sp = savepoints.take(live.settings, "clicks", "crashy", mode="continue")
    assert sp.status == "COMPLETED"
    savepoints.verify(Path(sp.path))


def test_a_corrupted_or_truncated_savepoint_is_refused_by_file_name(live: Live) -> None:
    sp = savepoints.take(live.settings, "clicks", "to-corrupt", mode="continue")
    deltas = sorted((Path(sp.path) / "stages" / "totals" / "state").rglob("*.delta"))
    flipped, truncated = deltas[0], deltas[-1]
    original = flipped.read_bytes()
    data = bytearray(original)
    data[len(data) // 2] ^= 0x01
    _replace(flipped, bytes(data))
    with pytest.raises(ChangeoverError, match=rf"{flipped.relative_to(sp.path)} is corrupted: its SHA-256"):
        live.launch("from-corrupt", savepoint="clicks/to-corrupt")
    _replace(flipped, original)
    savepoints.verify(Path(sp.path))
    _replace(truncated, truncated.read_bytes()[:-1])
    with pytest.raises(ChangeoverError, match=rf"{truncated.relative_to(sp.path)} is corrupted: the file has"):
        savepoints.restore(live.settings, "clicks", "to-corrupt")
    truncated.unlink()
    with pytest.raises(ChangeoverError, match=rf"{truncated.relative_to(sp.path)} is corrupted: the file is missing"):
        savepoints.verify(Path(sp.path))


def _replace(path: Path, data: bytes) -> None:
    """Write new bytes under the name, not into the inode: the savepoint shares inodes with the live job."""
    replacement = path.with_name(path.name + ".new")
    replacement.write_bytes(data)
    os.replace(replacement, path)


def test_resuming_an_older_savepoint_rewinds_the_sink_and_ends_exact(live: Live) -> None:
    s1 = savepoints.take(live.settings, "clicks", "older-1", mode="continue")
    live.wait_batches("clicks", 2)
    savepoints.take(live.settings, "clicks", "older-2", mode="continue")
    live.wait_batches("clicks", 1)
    savepoints.request_stop(live.settings, "clicks", reason="test")
    wait_for(lambda: jobs.refresh(live.settings, live.cluster, "clicks").state == "STOPPED", 120, "clicks stopping")
    with pytest.raises(ChangeoverError, match=r"the keyed_table sink of stage \w+ is ahead of the savepoint: it wrote"):
        jobs.resume(live.settings, live.cluster, "clicks", "older-1")
    run = jobs.resume(live.settings, live.cluster, "clicks", "older-1", rewind_sink=True)
    assert run.from_savepoint == "older-1"
    jobs.wait_until_committed(live.settings, live.cluster, "clicks")
    live.settle("clicks")
    with session_scope(live.settings.database_url) as s:  # every batch after the savepoint was written again
        writers = set(s.scalars(select(SinkLedger.run_id).where(
            SinkLedger.job == "clicks", SinkLedger.stage == "totals", SinkLedger.batch_id > s1.stages["totals"])))
    assert writers == {run.id}


def test_stage_rule_state_of_a_removed_stage_is_refused_unless_allowed(live: Live) -> None:
    savepoints.take(live.settings, "clicks", "rules", mode="continue", exist_ok=True)
    run = live.launch("totals-only", savepoint="clicks/rules", stages=["totals"])
    wait_for(lambda: jobs.refresh(live.settings, live.cluster, "totals-only").state == "FAILED", 180,
             "the driver refusing the unmatched state")
    run = jobs.refresh(live.settings, live.cluster, "totals-only")
    assert "holds state of stage(s) windows, which the job no longer has" in run.error
    assert run.first_commit_at is None and live.first_sink_batch("totals-only", "totals") is None
    jobs.resume(live.settings, live.cluster, "totals-only", "clicks/rules", allow_non_restored_state=True)
    jobs.wait_until_committed(live.settings, live.cluster, "totals-only")
    live.settle("totals-only")
    live.stop("totals-only")


def test_stage_rule_a_new_stage_starts_empty_and_a_rename_moves_a_stages_state(live: Live) -> None:
    """The continue savepoint's replay (above) restores stages by matching name; here a job of one stage grows a
    second one and renames the first, in one resume."""
    live.launch("small", stages=["totals"])
    jobs.wait_until_committed(live.settings, live.cluster, "small")
    sp = savepoints.take(live.settings, "small", "small-1", mode="continue")
    assert set(sp.stages) == {"totals"}
    live.stop("small")
    live.launch("grown", savepoint="small/small-1", stage_names={"totals": "running_totals"},
                rename_stages={"totals": "running_totals"})
    jobs.wait_until_committed(live.settings, live.cluster, "grown")
    # the renamed stage goes on from its state; windows had none in the savepoint: a fresh start at batch 0
    assert live.first_batches("grown", ["running_totals", "windows"]) == {
        "running_totals": sp.stages["totals"] + 1, "windows": 0}
    live.settle("grown")
    live.stop("grown")
