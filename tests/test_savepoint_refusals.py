"""Savepoint refusals that need only the registry and the filesystem."""

import json
from datetime import timedelta
from pathlib import Path

import pytest
from changeover import audit, savepoints
from changeover.errors import ChangeoverError
from changeover.handoff import lease
from changeover.registry.db import session_scope
from changeover.registry.models import Job, JobRun, Savepoint, UpgradeRun, utcnow
from changeover.runtime.sinks import hold_a_write_of
from changeover.savepoints import taking
from changeover.settings import Settings
from changeover.timeutil import as_utc
from changeover.upgrade import code_update
from sqlalchemy import select


def _job_with_checkpoint(settings: Settings, root: Path, state: str = "RUNNING") -> None:
    """A job row whose current run points at a real checkpoint folder (which may be empty)."""
    with session_scope(settings.database_url) as s:
        s.add(Job(name="clicks", module="jobs.clicks", fault_tolerant=True, block_shutdown=False, options={}))
        s.flush()
        run = JobRun(job="clicks", spark_version="4.2.0", master_url="spark://x", state=state,
                     checkpoint_root=str(root), progress={})
        s.add(run)
        s.flush()
        s.get(Job, "clicks").current_run_id = run.id


def _fake_committed_checkpoint(root: Path, batches: int = 2) -> None:
    """The file layout of a stage checkpoint that committed `batches` batches."""
    stage = root / "totals"
    for b in range(batches):
        (stage / "offsets").mkdir(parents=True, exist_ok=True)
        (stage / "commits").mkdir(parents=True, exist_ok=True)
        (stage / "offsets" / str(b)).write_text(f'v1\n{{"batchWatermarkMs":0}}\n{{"logOffset":{b}}}\n')
        (stage / "commits" / str(b)).write_text("v1\n{}\n")
        (stage / "state" / "0" / "0").mkdir(parents=True, exist_ok=True)
        (stage / "state" / "0" / "0" / f"{b + 1}.delta").write_bytes(bytes([b]) * 100)
    (stage / "offsets" / str(batches)).write_text("v1\n{}\n")  # in flight: kept, its commit not yet written
    (stage / "metadata").write_text('{"id":"q"}')


def test_unknown_job_and_unknown_savepoint_are_refused(settings: Settings, tmp_path: Path) -> None:
    with pytest.raises(ChangeoverError, match=r"job 'ghost': no such job"):
        savepoints.take(settings, "ghost", "sp1", mode="continue")
    _job_with_checkpoint(settings, tmp_path / "cp")
    with pytest.raises(ChangeoverError, match=r"savepoint 'nope' of job clicks: no such savepoint"):
        savepoints.restore(settings, "clicks", "nope")


def test_no_committed_batch_is_refused(settings: Settings, tmp_path: Path) -> None:
    (tmp_path / "cp" / "totals").mkdir(parents=True)
    _job_with_checkpoint(settings, tmp_path / "cp")
    with pytest.raises(ChangeoverError, match="the job has no committed batch yet"):
        savepoints.take(settings, "clicks", "sp1", mode="continue")
    with session_scope(settings.database_url) as s:
        assert s.scalars(select(Savepoint)).all() == []


def test_stop_mode_needs_a_stopped_job(settings: Settings, tmp_path: Path) -> None:
    _fake_committed_checkpoint(tmp_path / "cp")
    _job_with_checkpoint(settings, tmp_path / "cp", state="RUNNING")
    with pytest.raises(ChangeoverError, match="needs it stopped at a batch boundary"):
        savepoints.take(settings, "clicks", "sp1", mode="stop")


def test_short_space_is_refused_with_the_figures(settings: Settings, tmp_path: Path, monkeypatch) -> None:
    _fake_committed_checkpoint(tmp_path / "cp")
    _job_with_checkpoint(settings, tmp_path / "cp")
    monkeypatch.setenv("CHANGEOVER_SAVEPOINT_HEADROOM_BYTES", str(1 << 60))
    with pytest.raises(ChangeoverError, match=r"bytes are free in .* and it needs .* bytes of headroom"):
        savepoints.take(settings, "clicks", "sp1", mode="continue")
    assert not (settings.savepoint_dir / "clicks" / "sp1").exists()


def test_duplicate_name_is_refused_but_a_retry_gets_the_same_savepoint(settings: Settings, tmp_path: Path) -> None:
    _fake_committed_checkpoint(tmp_path / "cp")
    _job_with_checkpoint(settings, tmp_path / "cp")
    first = savepoints.take(settings, "clicks", "sp1", mode="continue")
    assert first.status == "COMPLETED" and first.stages == {"totals": 1}
    with pytest.raises(ChangeoverError, match="a savepoint of that name exists"):
        savepoints.take(settings, "clicks", "sp1", mode="continue")
    assert savepoints.take(settings, "clicks", "sp1", mode="continue", exist_ok=True).id == first.id


def test_a_retried_check_takes_its_savepoint_again_only_if_the_earlier_one_no_longer_verifies(
        settings: Settings, tmp_path: Path) -> None:
    _fake_committed_checkpoint(tmp_path / "cp")
    _job_with_checkpoint(settings, tmp_path / "cp")
    first = code_update.check_savepoint(settings, "clicks", "check-1")
    assert code_update.check_savepoint(settings, "clicks", "check-1").id == first.id  # usable: reused
    # a file of the running job's checkpoint, hard-linked into the savepoint, grows under it
    with (tmp_path / "cp" / "totals" / "state" / "0" / "0" / "1.delta").open("ab") as grown:
        grown.write(b"more")
    with pytest.raises(ChangeoverError, match="is corrupted"):
        savepoints.verify(Path(first.path))
    again = code_update.check_savepoint(settings, "clicks", "check-1")
    assert again.status == "COMPLETED"
    savepoints.verify(Path(again.path))  # a reused one would be refused here, on every retry
    deleted = [e.subject for e in audit.find(settings.database_url, job="clicks") if e.action == "savepoint.delete"]
    assert deleted == ["clicks/check-1"], deleted


def test_copy_is_pruned_to_the_committed_batch_and_hard_linked(settings: Settings, tmp_path: Path) -> None:
    _fake_committed_checkpoint(tmp_path / "cp", batches=3)
    _job_with_checkpoint(settings, tmp_path / "cp")
    sp = savepoints.take(settings, "clicks", "sp1", mode="continue")
    stage = Path(sp.path) / "stages" / "totals"
    # The in-flight batch 3's offsets are kept: a restore replays it with the same offsets. Its commit is not.
    assert sorted(p.name for p in (stage / "offsets").iterdir()) == ["0", "1", "2", "3"]
    assert sorted(p.name for p in (stage / "commits").iterdir()) == ["0", "1", "2"]
    assert sorted(p.name for p in (stage / "state" / "0" / "0").iterdir()) == ["1.delta", "2.delta", "3.delta"]
    original = tmp_path / "cp" / "totals" / "state" / "0" / "0" / "3.delta"
    assert (stage / "state" / "0" / "0" / "3.delta").stat().st_ino == original.stat().st_ino
    manifest = savepoints.verify(Path(sp.path))
    assert (manifest["stages"]["totals"]["batch"], manifest["stages"]["totals"]["replay_through"]) == (2, 3)
    assert manifest["stages"]["totals"]["source_offsets"] == [{"logOffset": 2}]
    assert "stages/totals/commits/2" in manifest["files"]


def test_retention_keeps_the_newest_and_what_an_unfinished_upgrade_uses(settings: Settings, tmp_path: Path) -> None:
    _fake_committed_checkpoint(tmp_path / "cp")
    _job_with_checkpoint(settings, tmp_path / "cp")
    for name in ("a", "b", "c", "d"):
        savepoints.take(settings, "clicks", name, mode="continue", upgrade_key="up-1" if name == "a" else None)
    with session_scope(settings.database_url) as s:
        s.add(UpgradeRun(key="up-1", target_version="4.3.0", members={}, status="RUNNING"))
        for sp in s.scalars(select(Savepoint)):
            sp.created_at = utcnow() - timedelta(days=10)
    assert sorted(savepoints.apply_retention(settings, "clicks", max_count=1)) == ["b", "c"]
    assert [sp["name"] for sp in savepoints.list_savepoints(settings)] == ["a", "d"]
    assert savepoints.apply_retention(settings, "clicks", max_age=timedelta(days=1)) == []
    with pytest.raises(ChangeoverError, match="the unfinished upgrade up-1 refers to it"):
        savepoints.delete(settings, "clicks", "a")


@pytest.mark.parametrize(("forged", "why"), [
    ({"files": {"../outside": {"size": 1, "sha256": "x"}}}, r"its file path '\.\./outside' leaves the savepoint"),
    ({"files": {"/etc/hostname": {"size": 1, "sha256": "x"}}}, r"its file path '/etc/hostname' leaves"),
    ({"stages": {"../totals": {"batch": 2}}}, r"its stage name '\.\./totals' is not a safe folder name"),
    ({"files": {"stages/link/x": {"size": 1, "sha256": "x"}}},
     r"its file path 'stages/link/x' leads out of the savepoint through a link"),
])
def test_a_manifest_whose_paths_leave_the_savepoint_is_refused(settings: Settings, tmp_path: Path,
                                                               forged: dict, why: str) -> None:
    _fake_committed_checkpoint(tmp_path / "cp")
    _job_with_checkpoint(settings, tmp_path / "cp")
    path = Path(savepoints.take(settings, "clicks", "sp1", mode="continue").path)
    assert savepoints.verify(path)["files"]  # the savepoint as taken is accepted
    (tmp_path / "elsewhere").mkdir()
    (path / "stages" / "link").symlink_to(tmp_path / "elsewhere")
    manifest = json.loads((path / savepoints.MANIFEST).read_text())
    for key, entries in forged.items():
        manifest[key] = {**manifest[key], **entries}
    (path / savepoints.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ChangeoverError, match=rf"savepoint clicks/sp1: {why}.*resume from another savepoint"):
        savepoints.verify(path)


def _pending_from(settings: Settings, root: Path, owner: str, lease_left: float) -> Path:
    """A savepoint being built by `owner`, its staging folder half written, its lease `lease_left` s away."""
    staging = settings.savepoint_dir / "clicks" / ".staging-sp1"
    (staging / "stages").mkdir(parents=True)
    with session_scope(settings.database_url) as s:
        s.add(Savepoint(job="clicks", name="sp1", mode="continue", status="PENDING",
                        path=str(settings.savepoint_dir / "clicks" / "sp1"), size_bytes=0, spark_version="4.2.0",
                        stages={"totals": 1}, owner=owner, lease_until=utcnow() + timedelta(seconds=lease_left)))
    return staging


def test_a_savepoint_another_host_is_building_is_left_alone_until_its_lease_lapses(settings: Settings,
                                                                                   tmp_path: Path) -> None:
    _fake_committed_checkpoint(tmp_path / "cp")
    _job_with_checkpoint(settings, tmp_path / "cp")
    staging = _pending_from(settings, tmp_path, owner="builder-host-2:4242:99", lease_left=600)

    assert savepoints.reconcile(settings) == {"rows": [], "folders": []}  # its PID means nothing here
    assert staging.exists()
    with pytest.raises(ChangeoverError, match="another process is taking it now"):
        savepoints.take(settings, "clicks", "sp1", mode="continue")

    with session_scope(settings.database_url) as s:  # the other host stopped renewing: its lease lapses
        s.scalar(select(Savepoint).where(Savepoint.name == "sp1")).lease_until = utcnow() - timedelta(seconds=1)
    taken = savepoints.take(settings, "clicks", "sp1", mode="continue")
    assert taken.status == "COMPLETED" and taken.lease_until is None and not staging.exists()


def test_a_dead_builder_on_this_host_is_cleared_at_once_whatever_its_lease(settings: Settings,
                                                                           tmp_path: Path) -> None:
    import socket

    _fake_committed_checkpoint(tmp_path / "cp")
    _job_with_checkpoint(settings, tmp_path / "cp")
    staging = _pending_from(settings, tmp_path, owner=f"{socket.gethostname()}:999999:1", lease_left=600)
    assert savepoints.reconcile(settings) == {"rows": ["clicks/sp1"], "folders": ["clicks/.staging-sp1"]}
    assert not staging.exists()


def test_a_long_build_renews_its_lease(settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_committed_checkpoint(tmp_path / "cp")
    _job_with_checkpoint(settings, tmp_path / "cp")
    monkeypatch.setenv("CHANGEOVER_SAVEPOINT_LEASE_SECONDS", "0.6")
    renewed: list[object] = []
    real_build = taking._build

    def slow_build(*args: object) -> Savepoint:
        """The copy takes five lease lengths; the lease must be renewed meanwhile, or another host clears it."""
        from changeover.cluster import wait_for

        def lease_moved() -> bool:
            with session_scope(settings.database_url) as s:
                renewed.append(s.scalar(select(Savepoint.lease_until).where(Savepoint.name == "sp2")))
            return len({r for r in renewed if r is not None}) >= 3
        wait_for(lease_moved, 10, "the savepoint's lease renewed twice")
        return real_build(*args)

    monkeypatch.setattr(taking, "_build", slow_build)
    assert savepoints.take(settings, "clicks", "sp2", mode="continue").status == "COMPLETED"


def test_a_stop_savepoint_of_a_parked_run_holds_its_lease_while_it_builds(settings: Settings, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`take` in mode stop hands the parked run to the build's lease (test_leases_and_fencing has the lease's own
    decisions): a copy slower than the job's lease keeps the run parked for its move, instead of letting it resume
    and park again under a new savepoint (the real copy, slowed by a fault point, is a `make test-e2e` case)."""
    _fake_committed_checkpoint(tmp_path / "cp")
    _job_with_checkpoint(settings, tmp_path / "cp", state="PARKED")
    monkeypatch.setenv("CHANGEOVER_LEASE_SECONDS", "3")  # renewed every second while the copy runs
    with session_scope(settings.database_url) as s:
        job = s.get(Job, "clicks")
        job.desired = "MOVE"
        run = s.get(JobRun, job.current_run_id)
        run.lease_until = first_until = utcnow() + timedelta(seconds=1)
        run_id = run.id

    def extensions() -> int:
        return len([e for e in audit.find(settings.database_url, job="clicks") if e.action == "job.lease.extend"])

    real_build = taking._build

    def slow_build(*args: object) -> Savepoint:
        from changeover.cluster import wait_for
        wait_for(lambda: extensions() >= 3 and utcnow() > first_until, 30, "the copy outlasting the run's lease")
        assert lease.next_action(settings.database_url, "clicks", run_id, hold_a_write_of) == "wait"
        return real_build(*args)

    monkeypatch.setattr(taking, "_build", slow_build)
    assert savepoints.take(settings, "clicks", "stop-1", mode="stop").status == "COMPLETED"
    with session_scope(settings.database_url) as s:
        assert as_utc(s.get(JobRun, run_id).lease_until) > first_until


def test_a_builder_whose_savepoint_was_taken_over_publishes_nothing(settings: Settings, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Builder A is slow; its lease lapsed and another host cleared its row and began its own build. When A
    comes to publish, the row is not its own: A removes its staging and leaves the other build alone."""
    _fake_committed_checkpoint(tmp_path / "cp")
    _job_with_checkpoint(settings, tmp_path / "cp")
    real_build = taking._build

    def taken_over_meanwhile(*args: object) -> Savepoint:
        with session_scope(settings.database_url) as s:  # what the other host's reconcile and take leave
            row = s.scalar(select(Savepoint).where(Savepoint.name == "sp3"))
            row.owner, row.lease_until = "builder-host-2:4242:99", utcnow() + timedelta(seconds=600)
        return real_build(*args)

    monkeypatch.setattr(taking, "_build", taken_over_meanwhile)
    with pytest.raises(ChangeoverError, match="this builder lost its lease on it"):
        savepoints.take(settings, "clicks", "sp3", mode="continue")
    with session_scope(settings.database_url) as s:
        row = s.scalar(select(Savepoint).where(Savepoint.name == "sp3"))
        assert (row.status, row.owner) == ("PENDING", "builder-host-2:4242:99")  # the other build's, untouched
    assert not (settings.savepoint_dir / "clicks" / "sp3").exists()
    assert [p.name for p in (settings.savepoint_dir / "clicks" / ".staging-sp3").iterdir()] == []
