"""A move's next step as a table: what `relocate.step` observes of the job's current run, and what it does next.
No registry and no Spark: `step` observes, calls `relocate.decide`, and acts on its answer (its actions run against
real clusters in test_leases_and_fencing.py and tests/faults)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from changeover.upgrade.relocate import Observation, decide

RUNNING = Observation(state="RUNNING", desired="RUN", placed=False, member_draining=False)

CASES = [
    ("running on the target, off the member", replace(RUNNING, placed=True), "done"),
    ("submitted on the target", replace(RUNNING, state="SUBMITTED", placed=True), "done"),
    ("running on the target, but asked to move again", replace(RUNNING, placed=True, desired="MOVE"), "stop"),
    ("running where it was", RUNNING, "stop"),
    ("asked to move, not parked yet (a retried try)", replace(RUNNING, desired="MOVE"), "stop"),
    ("a user stopped it", replace(RUNNING, desired="STOP"), "stopped_by_user"),
    ("a user stopped it, parked", replace(RUNNING, state="PARKED", desired="STOP"), "stopped_by_user"),
    ("parked for the move", replace(RUNNING, state="PARKED", desired="MOVE"), "save_and_launch"),
    ("stopped and ended, asked to move (its driver gone)", replace(RUNNING, state="STOPPED", desired="MOVE"),
     "save_and_launch"),
    ("killed on its way to the move", replace(RUNNING, state="KILLED", desired="MOVE"), "continue_from_checkpoint"),
    ("killed before it was asked, its member draining",
     replace(RUNNING, state="KILLED", member_draining=True), "continue_from_checkpoint"),
    ("killed, its member back in service (an abort)", replace(RUNNING, state="KILLED"), "ended"),
    ("failed on its own code", replace(RUNNING, state="FAILED", desired="MOVE"), "ended"),
    ("finished", replace(RUNNING, state="FINISHED"), "ended"),
]


@pytest.mark.parametrize(("observed", "decision"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_moves_next_step(observed: Observation, decision: str) -> None:
    assert decide(observed) == decision
