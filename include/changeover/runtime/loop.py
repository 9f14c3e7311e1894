"""The driver's running loop: each stage as one long-lived query, progress reported, a stop at a batch boundary,
the park under a lease for a move, and the stand-down while the registry does not answer.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from changeover import audit
from changeover.handoff import lease
from changeover.registry import db
from changeover.registry.db import TRANSIENT, patiently, refused, session_scope
from changeover.runtime import checkpoints
from changeover.runtime.contract import Stage, unmatched_state
from changeover.runtime.queries import StageQueries
from changeover.runtime.sinks import hold_a_write_of
from changeover.runtime.standby import Standby

log = logging.getLogger("changeover.driver")

T = TypeVar("T")
LOOP_SECONDS = 0.2


class GaveUp(Exception):
    """A parked or stood-down run ended itself: its registry refuses it, or has not answered for its whole patience.
    Not the job's failure: its queries are stopped, its checkpoint's last commit is a whole batch, and the job goes
    on from it."""


class Driver(Standby):
    """The driver of one run: it runs the job's stages until stopped, parks at a boundary for a move, and stands
    down while the registry does not answer; a standby first waits for its checkpoint (`Standby`)."""

    def run_streaming(self, stages: list[Stage], checkpoint_root: Path, allow_non_restored: bool = False,
                      spark: Any = None, plans: dict[str, Any] | None = None,
                      started: StageQueries | None = None) -> bool:
        """Run until stopped or handed over (`started`: the queries a follower started before its hand-over). False
        when the restored state does not fit the job's stages, or when it cannot resume where it parked."""
        names = [stage.name for stage in stages]
        if not self._restored_state_fits(names, checkpoint_root, allow_non_restored):
            return False
        # on the follower's checkpoint, its predecessor's batches never reach the sinks again (`InQueryReplay`), nor
        # count as this run's own commits
        queries = started or StageQueries(stages, checkpoint_root, self.url, self.job, self.run_id,
                                          replay=self._in_query_replay)
        seen = queries.started_from if started is not None else queries.position()  # its first commit is reported
        described_plans = plans if plans is not None else self.describe(spark, stages)
        patiently(partial(self.report, seen, committed=False, sinks={s.name: s.sink.describe() for s in stages},
                          plans=described_plans), self.registry)
        took_over = False
        if started is None:
            queries.start()
        self._queries, self._checkpoint_root, self._confirmed_at = queries, checkpoint_root, time.monotonic()
        triggered = False
        described: set[str] = set()
        reported = time.monotonic()
        while True:
            state = self.confirm(queries)
            if state == "fenced":
                queries.stop_now()
                self.report(queries.committed(), committed=False, state="STOPPED")
                return True
            if state in ("STOP", "MOVE"):
                after = self._stop_at_boundary(queries, state, seen, checkpoint_root)
                if after is None:
                    return True
                seen = after
                continue
            failure = queries.failure()
            if failure is not None:
                if self._patiently(self.stop_state) == "fenced":
                    continue  # a fenced write failed its batch: nothing of it landed; the next turn stops
                raise failure
            now = queries.committed()
            advanced = now != seen
            if not (triggered and took_over) and (advanced or queries.have_run()):
                if not triggered:
                    self._patiently(self.mark_first_trigger)
                    triggered = True
                if not took_over:
                    took_over = self._patiently(partial(lease.take_over, self.url, self.job, self.run_id))
            fresh = [n for n in names if n not in described and now[n] is not None]
            if spark is not None and fresh:
                self._patiently(partial(self.report_operators, spark, checkpoint_root, fresh))
                described.update(fresh)
            if advanced or time.monotonic() - reported >= lease.HEARTBEAT_SECONDS:
                try:
                    self.report(now, committed=advanced)
                    seen, reported = now, time.monotonic()
                except TRANSIENT as exc:  # SQLite busy past its timeout, a restarting server: the queries go on
                    log.warning("job %s run %s: progress not recorded (%s); retrying", self.job, self.run_id, exc)
            time.sleep(LOOP_SECONDS)

    def _restored_state_fits(self, names: list[str], checkpoint_root: Path, allow_non_restored: bool) -> bool:
        """The stage rules (`unmatched_state`) over the restored checkpoint: False, the run failed with the refusal,
        when it holds state of a stage the job no longer has and that is not allowed; allowed, that state is set
        aside."""
        if len(set(names)) != len(names):
            raise ValueError(f"job {self.job}: stage names must be unique, got {names}")
        restored = set(checkpoints.stage_names(checkpoint_root))
        refusal = unmatched_state(self.job, restored, set(names))
        if refusal and not allow_non_restored:
            print(refusal, file=sys.stderr, flush=True)
            self.fail(refusal)
            return False
        for orphan in restored - set(names):  # allowed: set aside, so later savepoints do not carry it
            (checkpoint_root / orphan).rename(checkpoint_root / f".dropped-{orphan}")
        return True

    def _stop_at_boundary(self, queries: StageQueries, state: str, seen: dict[str, int | None],
                          checkpoint_root: Path) -> dict[str, int | None] | None:
        """A stop asked (STOP; MOVE parks): the queries stopped at a batch boundary. None once the run has ended
        (stopped, or handed over from its park); else the progress it goes on from: `seen` when the stop failed past
        its deadline and was withdrawn, the parked position when the park resumed."""
        announce = self._announce_last_batch if state == "MOVE" else None
        followed = state == "MOVE" and self._patiently(partial(lease.is_followed, self.url, self.run_id))
        if not queries.stop_at_boundary(self.stop_deadline, after_commit=state == "MOVE", on_last=announce,
                                        fresh=followed):
            self._patiently(partial(self.stop_failed, state))
            return seen
        now = queries.committed()
        self._patiently(partial(self.report, now, committed=now != seen))
        if state == "STOP" or not self._park(now, checkpoint_root):
            if state == "STOP":
                self._patiently(partial(self.report, now, committed=False, state="STOPPED"))
            return None
        queries.start()
        self._confirmed_at = time.monotonic()  # the lease's decision to resume said it is current
        return now

    def _announce_last_batch(self, batches: dict[str, int]) -> None:
        """Best effort: unsaid, the follower replays only committed batches until this run has parked, and starts its
        queries later."""
        try:
            lease.announce_last_batch(self.url, self.run_id, batches)
        except Exception as exc:  # noqa: BLE001 - the stop goes on whatever the registry said
            log.warning("job %s run %s: the batch it stops after was not recorded (%s)", self.job, self.run_id, exc)

    def _patiently(self, call: Callable[[], T]) -> T:
        """A registry call of the running loop, waited for while the registry does not answer. Every sink's write
        waits for the registry inside the fence meanwhile, so none lands unconfirmed; past `self_fence_seconds`
        the driver stands down (`fence_self`). A driver that stood down ends itself when the registry refuses it or
        has not answered for its whole patience: the job goes on from its checkpoint."""
        try:
            return patiently(call, self.registry, while_waiting=self.fence_self)
        except TRANSIENT as exc:
            if self._stood_down_at is None or self._checkpoint_root is None:
                raise
            self._give_up(self._checkpoint_root, exc, f"stood down, it ended after "
                          f"{time.monotonic() - self._confirmed_at:.0f} s without confirming that it is its job's "
                          "current run")

    def confirm(self, queries: StageQueries) -> str:
        """`stop_state`, waited for. A run that stood down starts its queries again once the registry says it is
        still its job's current one and should run (its batches replay from the last commit)."""
        state = self._patiently(self.stop_state)
        self._confirmed_at = time.monotonic()
        if self._stood_down_at is not None:
            seconds, self._stood_down_at = time.monotonic() - self._stood_down_at, None
            if state == "RUN":
                queries.start()
            self.record_stand_down(seconds, state)
        return state

    def fence_self(self, waited_for: BaseException) -> None:
        """Between the running loop's retries: past `self_fence_seconds` without confirming that this run is its
        job's current one, because the registry does not answer (not a lock or a conflict, which it answers with),
        stop its queries, a batch waiting inside its write included, before the control plane may record the run
        lost for its silence and let a successor write."""
        queries = self._queries
        if queries is None or not queries.queries or self._stood_down_at is not None or not db.away(waited_for):
            return
        unconfirmed = time.monotonic() - self._confirmed_at
        if unconfirmed < self.self_fence_seconds:
            return
        self._stood_down_at = time.monotonic()
        stopped = queries.stand_down_now()
        log.error("job %s run %s: not confirmed as its job's current run for %.0f s (the registry does not answer): "
                  "stopped its queries %s until it is", self.job, self.run_id, unconfirmed, stopped)

    def stand_down_queries(self) -> None:
        if self._in_query_replay is not None:  # a write hook waiting on the predecessor ends first
            self._in_query_replay.cancelled.set()
        if self._queries is not None:
            self._queries.stand_down.set()

    def record_stand_down(self, seconds: float, state: str) -> None:
        """Best effort: the registry that just answered may be gone again, and the queries run meanwhile."""
        then = {"RUN": "resumed", "fenced": "stopped"}.get(state, state.lower())
        stages = [stage.name for stage in (self._queries.stages if self._queries else [])]
        log.info("job %s run %s: confirmed after standing down %.0f s; %s", self.job, self.run_id, seconds, then)
        try:
            with session_scope(self.url) as s:
                audit.record(s, "job.self_fenced", "job", self.job, outcome="ok", run=self.run_id, stages=stages,
                             seconds=round(seconds, 1), then=then)
        except TRANSIENT as exc:
            log.warning("job %s run %s: its stand-down was not recorded (%s)", self.job, self.run_id, exc)

    def _park(self, progress: dict[str, int | None], checkpoint_root: Path) -> bool:
        """Stopped at a batch boundary: wait, holding the lease, until handed over (False) or resumed (True)."""
        patiently(lambda: lease.park(self.url, self.job, self.run_id, progress, self.lease_seconds), self.registry)
        log.info("job %s run %s parked at %s for up to %.0f s", self.job, self.run_id, progress, self.lease_seconds)
        while (decision := self._next_action(checkpoint_root)) == "wait":
            time.sleep(0.5)
        log.info("job %s run %s: %s", self.job, self.run_id, decision)
        return decision == "resume"

    def _give_up(self, checkpoint_root: Path, exc: Exception, how: str) -> NoReturn:
        """End this run by itself, its reason beside its checkpoint (for the run's `job.end`): the registry refuses
        it, or has not answered for its whole patience."""
        answer = "refused it" if refused(exc) else "did not answer"
        reason = f"{how}: the registry {answer} ({str(getattr(exc, 'orig', None) or exc).strip().splitlines()[0]})"
        log.error("job %s run %s: %s", self.job, self.run_id, reason)
        checkpoints.write_gave_up(checkpoint_root, reason)
        raise GaveUp(reason) from exc

    def _next_action(self, checkpoint_root: Path) -> lease.ParkedAction:
        """The lease's next action (`lease.next_action`); a registry that does not answer means wait, not fail: the
        run is parked on a clean boundary, and failing would leave it unresumable. It waits for the registry's patience
        at most, and not at all on a database that answered no for good (a refused password, a missing or read-only
        database): then the driver ends, freeing its cores (its master then reports it ended)."""
        try:
            decision = lease.next_action(self.url, self.job, self.run_id, hold_a_write_of)
        except TRANSIENT as exc:
            now = time.monotonic()
            self._unanswered_since = self._unanswered_since or now
            answered_no = refused(exc)
            if answered_no or now - self._unanswered_since > db.REGISTRY_PATIENCE_SECONDS:
                self._give_up(checkpoint_root, exc, f"parked, it gave up its lease and ended after "
                              f"{now - self._unanswered_since:.0f} s")
            log.warning("%s: the database did not answer (%s); still parked", self.registry, exc)
            return "wait"
        self._unanswered_since = None
        return decision
