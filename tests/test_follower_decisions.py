"""What a zero-downtime move decides from checkpoint files, without Spark: how far a follower is behind, how many
batches it has replayed itself, and how long each input file waited for the sink around a move. The checkpoints
here are written in Spark's own layout (offset log v1, a file source's log, commit files), with their times set."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from changeover.cluster import wait_for
from changeover.errors import ChangeoverError
from changeover.jobs import freshness
from changeover.runtime import checkpoints
from changeover.runtime.follower import Follower, InQueryReplay, PlannedPast, Withdrawn, lag, replayed_since
from changeover.upgrade import zero_downtime

T0 = 1_800_000_000.0  # the checkpoints' clock, in POSIX seconds


def batch(stage: Path, number: int, log_offset: int, files: dict[int, float], committed_at: float | None) -> None:
    """Batch `number` read the file source's log entries after the last batch's, up to `log_offset`: `files` gives,
    per entry, when its one file arrived. Committed at `committed_at`, or planned only (None)."""
    for folder in ("offsets", "commits", "sources/0"):
        (stage / folder).mkdir(parents=True, exist_ok=True)
    (stage / "offsets" / str(number)).write_text(
        'v1\n{"batchWatermarkMs":0,"batchTimestampMs":0,"conf":{}}\n' + json.dumps({"logOffset": log_offset}) + "\n")
    for entry, arrived in files.items():
        line = {"path": f"file:///in/{entry}.json", "timestamp": int(arrived * 1000), "batchId": entry}
        (stage / "sources" / "0" / str(entry)).write_text("v1\n" + json.dumps(line) + "\n")
    if committed_at is not None:
        commit = stage / "commits" / str(number)
        commit.write_text('v1\n{"nextBatchWatermarkMs":0}\n')
        os.utime(commit, (committed_at, committed_at))


def test_the_largest_wait_around_a_move_is_the_file_that_arrived_as_the_old_run_stopped(tmp_path: Path) -> None:
    before, after = tmp_path / "old" / "counts", tmp_path / "new" / "counts"
    for n in range(4):  # one file a second, each committed 1.2 s after it arrived
        batch(before, n, n, {n: T0 + n}, T0 + n + 1.2)
    batch(before, 2, 2, {2: T0 + 2}, T0 + 11.0)  # a stall of the old run before the move (an executor lost): not its
    # the new run's checkpoint holds the old one's batches (a restored savepoint), then its own
    for n in range(4):
        batch(after, n, n, {n: T0 + n}, T0 + n + 1.2)
    batch(after, 4, 6, {4: T0 + 3.5, 5: T0 + 4.5, 6: T0 + 5.5}, T0 + 6.0)  # the cut-over: 3 files waited
    batch(after, 5, 7, {7: T0 + 6.5}, T0 + 7.4)
    assert freshness.largest_gap(before, after) == pytest.approx(2.5, abs=0.01)  # the file of T0 + 3.5
    assert freshness.of_move(str(tmp_path / "old"), str(tmp_path / "new")) == pytest.approx(2.5, abs=0.01)
    assert freshness.arrivals(after, 4) == [pytest.approx(T0 + 3.5), pytest.approx(T0 + 4.5), pytest.approx(T0 + 5.5)]


def test_a_moves_baseline_is_the_old_runs_usual_batch_of_its_own(tmp_path: Path) -> None:
    """The old run's checkpoint begins with batches it did not run (a restored savepoint's, or its replays as a
    follower), then the first batches of its own carry the move that brought the job to it: neither is its usual."""
    old = tmp_path / "old" / "counts"
    for n in range(3):  # restored: committed before the run began
        batch(old, n, n, {n: T0 + n}, T0 + n + 1.0)
    since = T0 + 100.0  # its first commit as the job's run
    for n in range(3, 10):  # its own, a commit every 2 s: the first three waited out a move, then one stall
        committed = since + 2 * (n - 3)
        batch(old, n, n, {n: committed - (8.0 if n < 6 else 9.0 if n == 8 else 1.5)}, committed)
    assert freshness.usual_gap(old, since) == pytest.approx(1.5, abs=0.01)  # 6 to 9, the stall among them
    assert freshness.usual_gap(old, since, batches=3) == pytest.approx(1.5, abs=0.01)  # 7, 8 and 9
    assert freshness.usual_gap(old, since, batches=2) is None  # too few to go by
    assert freshness.usual_gap(old, T0) == pytest.approx(8.0, abs=0.01)  # not told which are its own: the move's
    assert freshness.usual_gap(old, since + 8.0) is None  # 7 to 9 its own: none left once the first 3 are set aside
    (tmp_path / "new" / "counts").mkdir(parents=True)
    assert freshness.usual_before_move(str(tmp_path / "old"), str(tmp_path / "new"), since) == pytest.approx(1.5,
                                                                                                           abs=0.01)
    assert freshness.usual_before_move(str(tmp_path / "old"), str(tmp_path / "new"), None) is None


def test_a_move_of_a_stage_without_file_input_has_no_freshness(tmp_path: Path) -> None:
    for root, batches in (("old", range(2)), ("new", range(4))):
        stage = tmp_path / root / "rates"
        (stage / "commits").mkdir(parents=True)
        (stage / "offsets").mkdir()
        for n in batches:
            (stage / "commits" / str(n)).write_text("v1\n{}\n")
            (stage / "offsets" / str(n)).write_text('v1\n{}\n{"0":5}\n')  # a source of another kind
    assert freshness.largest_gap(tmp_path / "old" / "rates", tmp_path / "new" / "rates") is None
    assert freshness.of_move(str(tmp_path / "old"), str(tmp_path / "new")) is None
    assert freshness.of_move(None, str(tmp_path / "new")) is None
    assert freshness.usual_before_move(str(tmp_path / "old"), str(tmp_path / "new"), T0) is None


def test_an_entry_spark_compacted_away_is_read_from_the_compaction_and_a_purged_batch_gives_no_figure(
        tmp_path: Path) -> None:
    before, after = tmp_path / "old" / "counts", tmp_path / "new" / "counts"
    for stage in (before, after):
        for n in range(3):
            batch(stage, n, n, {n: T0 + n}, T0 + n + 1.0)
    batch(after, 3, 3, {3: T0 + 2.0}, T0 + 6.0)
    # the file source compacted its log at 9 and deleted entry 3: the compaction holds every entry, each once
    compacted = [{"path": f"file:///in/{n}.json", "timestamp": int((T0 + (2.0 if n == 3 else n)) * 1000),
                  "batchId": n} for n in range(10)]
    (after / "sources" / "0" / "9.compact").write_text("v1\n" + "\n".join(json.dumps(c) for c in compacted))
    (after / "sources" / "0" / "3").unlink()
    assert freshness.arrivals(after, 3) == [pytest.approx(T0 + 2.0)]  # its own line only, not the whole log
    assert freshness.largest_gap(before, after) == pytest.approx(4.0, abs=0.01)
    (after / "offsets" / "2").unlink()  # purged: which entries batch 3 read is no longer known
    assert freshness.arrivals(after, 3) is None
    assert freshness.largest_gap(before, after) is None  # not the old run's side alone


def test_lag_and_replays_count_commits_not_offsets(tmp_path: Path) -> None:
    leader, follower = tmp_path / "leader", tmp_path / "follower"
    for n in range(6):
        batch(leader / "counts", n, n, {n: T0 + n}, T0 + n + 1)
    batch(leader / "counts", 6, 6, {6: T0 + 6}, None)  # planned, not committed: not yet followable
    for n in range(3):  # restored from a savepoint: links to files committed before it followed
        batch(follower / "counts", n, n, {n: T0 + n}, T0 + n + 1)
    batch(follower / "counts", 3, 3, {3: T0 + 3}, T0 + 100)  # its own replay, after it began following
    assert lag(leader, follower, ["counts"]) == {"counts": 2}
    assert lag(leader, follower, ["idle"]) == {"idle": 0}  # a stage neither has committed
    assert replayed_since(follower, ["counts"], T0 + 50) == {"counts": 1}
    assert checkpoints.last_commit(follower / "counts") == 3
    # a follower that ended itself removed its checkpoint: the orchestrator's look finds it far behind, not an error
    assert replayed_since(tmp_path / "removed", ["counts"], T0 + 50) == {"counts": 0}
    assert lag(leader, tmp_path / "removed", ["counts"]) == {"counts": 6}


def test_a_move_strategy_must_be_one_changeover_knows() -> None:
    assert zero_downtime.strategy_of(None, {}) == "warm"
    assert zero_downtime.strategy_of(None, {"move_strategy": "zero_downtime"}) == "zero_downtime"
    assert zero_downtime.strategy_of("warm", {"move_strategy": "zero_downtime"}) == "warm"  # the DAG's Param wins
    with pytest.raises(ChangeoverError, match=r"move strategy 'instant': the strategies are warm, zero_downtime"):
        zero_downtime.strategy_of("instant", {})


class ReplayedFrame:
    """Stands in for a replayed batch's DataFrame: its runs (Spark's noop write) go to `events`."""

    def __init__(self, events: list[str] | None = None) -> None:
        self.events = events if events is not None else []
        self.write = self

    def format(self, _name: str) -> ReplayedFrame:
        return self

    def mode(self, _mode: str) -> ReplayedFrame:
        return self

    def save(self) -> None:
        self.events.append("run")


def _follower_short_of(tmp_path: Path, stopped: bool) -> tuple[Follower, Path]:
    """A follower that committed batches 0-2 of stage counts; its leader committed 0-3 (its last: 3)."""
    leader, own = tmp_path / "leader", tmp_path / "own"
    for n in range(4):
        batch(leader / "counts", n, n, {n: T0 + n}, T0 + n + 1)
    for n in range(3):
        batch(own / "counts", n, n, {n: T0 + n}, T0 + n + 1)
    return Follower(None, [SimpleNamespace(name="counts")], own, leader, lambda: stopped), leader  # type: ignore[list-item]


def test_queries_primed_short_of_the_last_batch_run_it_without_writing_then_say_the_follower_is_level(
        tmp_path: Path) -> None:
    """In the job's own queries, the leader's last batch is computed without writing and let through to Spark's
    commit only once the leader has committed it and stopped, the follower said level first; later batches are the
    sink's."""
    follower, _ = _follower_short_of(tmp_path, stopped=True)
    assert follower.level_short_of({"counts": 3}) and not follower.level_short_of({"counts": 2})
    assert not follower.level_short_of({"counts": 3, "other": 0})
    follower.take_batch("counts", 3)
    assert checkpoints.last_offsets(tmp_path / "own" / "counts") == 3  # the leader's entry, uncommitted
    events: list[str] = []
    hook = InQueryReplay(follower, {"counts": 3}, lambda: events.append("level"), lambda: None)
    assert hook("counts", ReplayedFrame(events), 3) and events == ["run", "level"] and hook.levelled.is_set()
    assert not hook("counts", ReplayedFrame(events), 4) and events == ["run", "level"]  # its own: the sink's


def test_queries_primed_short_of_the_last_batch_stop_before_a_batch_the_leader_planned_past_it(
        tmp_path: Path) -> None:
    """The leader logged batch 4 as its stop came: the queries would plan 4 with offsets of their own, so the replay
    of 3 fails, uncommitted and not level, and the follower takes the leader's 4 instead."""
    follower, leader = _follower_short_of(tmp_path, stopped=True)
    batch(leader / "counts", 4, 4, {4: T0 + 4}, None)
    events: list[str] = []
    hook = InQueryReplay(follower, {"counts": 3}, lambda: events.append("level"), lambda: None)
    with pytest.raises(PlannedPast, match="logged batch 4"):
        hook("counts", ReplayedFrame(events), 3)
    assert events == ["run"] and isinstance(hook.raised, PlannedPast) and not hook.levelled.is_set()


def test_queries_primed_short_of_the_last_batch_wait_for_the_leaders_stop_and_end_with_the_cut_over(
        tmp_path: Path) -> None:
    """The leader committed its last batch but has not stopped: the replay waits, looking whether the cut-over still
    comes, and ends with it (its stop failed: the leader runs on, and a batch past it would be planned twice)."""
    follower, _ = _follower_short_of(tmp_path, stopped=False)
    events: list[str] = []

    def check_cut_over() -> None:
        events.append("look")
        raise RuntimeError("the cut-over ended")

    hook = InQueryReplay(follower, {"counts": 3}, lambda: events.append("level"), check_cut_over)
    with pytest.raises(RuntimeError, match="the cut-over ended"):
        hook("counts", ReplayedFrame(events), 3)
    assert events == ["run", "look"] and isinstance(hook.raised, RuntimeError)
    stopping = InQueryReplay(follower, {"counts": 3}, lambda: None, lambda: None)
    stopping.cancelled.set()  # its queries are being stopped: the wait ends at its first look
    with pytest.raises(Withdrawn, match="its queries are stopping"):
        stopping("counts", ReplayedFrame(), 3)


def _two_stages_short_of(tmp_path: Path) -> Follower:
    """Stages counts and totals: the follower committed 0-2 of each, its leader 0-3 and stopped."""
    follower, leader = _follower_short_of(tmp_path, stopped=True)
    for n in range(4):
        batch(leader / "totals", n, n, {n: T0 + n}, T0 + n + 1)
    for n in range(3):
        batch(tmp_path / "own" / "totals", n, n, {n: T0 + n}, T0 + n + 1)
    follower.stages.append(SimpleNamespace(name="totals"))  # type: ignore[arg-type]
    return follower


def _replay_in_thread(hook: InQueryReplay, stage: str, events: list[str]) -> threading.Thread:
    """The stage's write of its last replayed batch on a thread of its own, as Spark runs each query's."""
    def write() -> None:
        try:
            events.append(f"{stage} returned {hook(stage, ReplayedFrame(events), 3)}")
        except Exception as exc:  # noqa: BLE001 - what the hook raised is the subject
            events.append(f"{stage} raised {type(exc).__name__}")
    thread = threading.Thread(target=write)
    thread.start()
    wait_for(lambda: "run" in events, 30, f"stage {stage}'s batch run")
    return thread


def test_a_stage_level_at_the_last_batch_waits_for_the_others_and_the_follower_is_said_level_once(
        tmp_path: Path) -> None:
    """No stage commits the leader's last batch before every stage has reached it: another could still refuse it."""
    follower = _two_stages_short_of(tmp_path)
    assert follower.level_short_of({"counts": 3, "totals": 3})
    events: list[str] = []
    hook = InQueryReplay(follower, {"counts": 3, "totals": 3}, lambda: events.append("level"), lambda: None)
    first = _replay_in_thread(hook, "counts", events)
    assert hook("totals", ReplayedFrame(events), 3)
    first.join(timeout=30)
    assert events == ["run", "run", "level", "counts returned True"] and hook.levelled.is_set()


def test_a_stage_refusing_the_last_batch_withdraws_the_others_waiting_at_theirs(tmp_path: Path) -> None:
    """The leader logged batch 4 of totals as its stop came: counts, level and waiting, is withdrawn uncommitted, and
    both stages prime as before."""
    follower = _two_stages_short_of(tmp_path)
    batch(tmp_path / "leader" / "totals", 4, 4, {4: T0 + 4}, None)
    events: list[str] = []
    hook = InQueryReplay(follower, {"counts": 3, "totals": 3}, lambda: events.append("level"), lambda: None)
    first = _replay_in_thread(hook, "counts", events)
    with pytest.raises(PlannedPast, match="stage totals: the leader logged batch 4"):
        hook("totals", ReplayedFrame(events), 3)
    first.join(timeout=30)
    assert events == ["run", "run", "counts raised Withdrawn"] and not hook.levelled.is_set()
    assert isinstance(hook.raised, PlannedPast)  # the first refusal, not the withdrawal it caused


def test_queries_started_again_count_a_stage_that_committed_the_last_batch_as_level(tmp_path: Path) -> None:
    """Stood down and started again (or handed the job as the cut-over ended), the queries replay the last batch only
    where it is not committed yet: a stage that committed it will not reach it again, and must not be waited for.
    What was raised or cancelled before is forgotten."""
    follower = _two_stages_short_of(tmp_path)
    events: list[str] = []
    hook = InQueryReplay(follower, {"counts": 3, "totals": 3}, lambda: events.append("level"), lambda: None)
    hook.cancelled.set()
    with pytest.raises(Withdrawn):
        hook("counts", ReplayedFrame(events), 3)
    batch(tmp_path / "own" / "counts", 3, 3, {3: T0 + 3}, T0 + 4)  # committed meanwhile
    hook.restart(follower.committed())
    assert hook.raised is None and not hook.levelled.is_set()
    assert hook("totals", ReplayedFrame(events), 3) and events == ["run", "run", "level"] and hook.levelled.is_set()


def test_the_jobs_queries_cancel_their_replays_wait_when_they_stand_down_and_forget_it_when_they_start_again(
        tmp_path: Path) -> None:
    """`StageQueries`' side of the hook: a stand-down ends a replay waiting on the predecessor (Spark's stop waits
    for the write to return), and a start on the follower's checkpoint begins the hook anew."""
    from changeover.runtime.queries import StageQueries

    follower = _two_stages_short_of(tmp_path)
    hook = InQueryReplay(follower, {"counts": 3, "totals": 3}, lambda: None, lambda: None)
    queries = StageQueries([], tmp_path / "own", "sqlite://", "clicks", 5, replay=hook)
    queries.stand_down_now()
    assert hook.cancelled.is_set()
    hook.raised = PlannedPast("stage totals: the leader logged batch 4 before it stopped")
    queries.start()
    assert not hook.cancelled.is_set() and hook.raised is None


def test_queries_primed_short_of_a_batch_the_leader_stopped_without_committing_withdraw_it(tmp_path: Path) -> None:
    follower, leader = _follower_short_of(tmp_path, stopped=True)
    (leader / "counts" / "commits" / "3").unlink()
    hook = InQueryReplay(follower, {"counts": 3}, lambda: None, lambda: None)
    with pytest.raises(Withdrawn, match="stopped without committing"):
        hook("counts", ReplayedFrame(), 3)


def test_primed_queries_have_run_only_past_the_predecessors_batch_they_replayed(tmp_path: Path) -> None:
    """A run that takes over once its queries have run a trigger (`lease.take_over`, after which its parked
    predecessor exits) must not count the predecessor's last batch, which its primed queries replayed without writing:
    a failure on its own first batch then still hands the job back."""
    from changeover.runtime.queries import StageQueries

    batch(tmp_path / "counts", 2, 2, {2: T0}, T0 + 1)  # the follower's own last commit: 2, before the primed 3
    queries = StageQueries([SimpleNamespace(name="counts")], tmp_path, "sqlite://", "clicks", 5,  # type: ignore[list-item]
                           replay=SimpleNamespace(through={"counts": 3}))  # type: ignore[arg-type]
    assert queries.position() == {"counts": 3}  # started again on it after a failure, 3 is still not its own
    queries.queries = {"counts": SimpleNamespace(lastProgress={"batchId": 3})}
    queries.started_from = queries.position()
    assert not queries.have_run()
    queries.queries["counts"].lastProgress = {"batchId": 4}
    assert queries.have_run()
    queries.started_from = {"counts": None}  # a stage that never committed: any trigger is its own
    queries.queries["counts"].lastProgress = {"batchId": 0}
    assert queries.have_run()
