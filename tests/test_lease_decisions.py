"""The parked run's rules as a table: what it observes under the job row's lock, and what it does. No registry and
no Spark: `lease.next_action` reads the rows, calls `decide_parked`, and writes what it returns (tested against real
registries in test_leases_and_fencing.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from changeover.handoff.lease import Parked, Successor, decide_parked

PARKED = Parked(ended=False, desired="MOVE", current=False, taken_over_since=False, expired=False, successor=None)
STARTING = Successor(id=9, state="SUBMITTED", wrote=False, ended=False, starting=True)
SILENT = replace(STARTING, starting=False)

# (case, observed, decision, event, reclaim, run_again)
CASES = [
    ("recorded as ended", replace(PARKED, ended=True), "exit", "job.handoff", False, False),
    ("stopped by a user", replace(PARKED, desired="STOP", current=True), "exit", "job.stop", False, False),
    ("a later run wrote", replace(PARKED, taken_over_since=True, expired=True), "exit", "job.handoff", False, False),
    ("the successor wrote", replace(PARKED, successor=replace(STARTING, wrote=True)), "exit", "job.handoff", False,
     False),
    ("the successor ended before writing", replace(PARKED, successor=replace(STARTING, ended=True, state="FAILED")),
     "resume", "job.unpark", True, True),
    ("a starting successor, lease out", replace(PARKED, expired=True, successor=STARTING), "wait", None, False, False),
    ("a silent successor, lease out", replace(PARKED, expired=True, successor=SILENT), "resume", "job.unpark", True,
     True),
    ("a silent successor, lease left", replace(PARKED, successor=SILENT), "wait", None, False, False),
    ("no successor row, lease out", replace(PARKED, expired=True), "resume", "job.unpark", True, True),
    ("still current, the stop withdrawn", replace(PARKED, current=True, desired="RUN"), "resume", "job.unpark", False,
     False),
    ("still current, lease left", replace(PARKED, current=True), "wait", None, False, False),
    ("still current, lease out", replace(PARKED, current=True, expired=True), "resume", "job.unpark", False, True),
]


@pytest.mark.parametrize(("observed", "decision", "event", "reclaim", "run_again"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_a_parked_runs_decision(observed: Parked, decision: str, event: str | None, reclaim: bool,
                                run_again: bool) -> None:
    verdict = decide_parked(observed)
    assert (verdict.decision, verdict.event, verdict.reclaim, verdict.run_again) == (decision, event, reclaim,
                                                                                    run_again)


def test_every_resume_says_why() -> None:
    reasons = {c[0]: decide_parked(c[1]).reason for c in CASES if decide_parked(c[1]).decision == "resume"}
    assert reasons["the successor ended before writing"] == "its successor run 9 ended FAILED before writing anything"
    assert all(reasons.values())
