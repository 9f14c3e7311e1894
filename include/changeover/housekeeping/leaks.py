"""The leak checker (issue 25): where the registry and Spark disagree, and what crashed work left behind.

A leak is one of these kinds:
- `run`: a run the registry holds alive (running, parked or a standby) whose driver its master no longer reports;
- `light_job`: a RUNNING light job whose member's Connect server is gone, and the job's session with it;
- `driver`: a driver on a Changeover master that no run the registry holds alive accounts for;
- `app`: an application on a master that neither a live run's job nor a running Connect server accounts for;
- `pidfile`: a PID file under the cluster folder whose process group is no longer ours and running;
- `savepoint`, `savepoint_folder`: what crashed savepoints left, as `savepoints.reconcile` finds it;
- `sink_staging`: a file sink's staging folder (`runtime.sinks.files.STAGING`) of a run that has ended.

A leak seen for less than the grace is only reported: what looks leaked may be work between two of its writes (a
launch between its submission and its record, a savepoint between its row and its folder). Its first sighting is
a `leak.found` event, so the grace holds across checks and processes; `leak.cleaned` records its cleanup, and
`leak.gone` one that stopped being a leak before (it ended by itself, or its owner recorded it meanwhile).

`observe` sees (its finders are in `leak_finders`), `decide`, a pure function, makes the plan, and `act` carries it
out, looking at each leak again before it touches it (its cleaners are in `leak_cleaners`); `check` is the one entry
point. Nothing is ended that Changeover did not start: a driver through its master's REST kill (as `jobs.cancel`), a
Connect server by the process group Changeover started (`Membership.stop_connect`), and an application with neither
handle is only reported.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy.orm import Session

from changeover import audit
from changeover.cluster.membership import Membership
from changeover.errors import ChangeoverError
from changeover.housekeeping.leak_cleaners import CLEANERS
from changeover.housekeeping.leak_finders import CLEANED, FOUND, GONE, MASTER_KINDS, Leak, Observation, observe
from changeover.registry.db import session_scope
from changeover.registry.models import utcnow
from changeover.settings import Settings
from changeover.timeutil import as_utc


@dataclass
class LeakPlan:
    grace_seconds: float
    leaks: list[Leak] = field(default_factory=list)  # every leak seen now
    first_seen: dict[tuple[str, str], datetime] = field(default_factory=dict)
    new: set[tuple[str, str]] = field(default_factory=set)  # first seen now: recorded as found
    waiting: dict[tuple[str, str], float] = field(default_factory=dict)  # key -> seconds before it may be cleaned
    clean: list[Leak] = field(default_factory=list)  # past its grace: cleaned now
    reported: list[Leak] = field(default_factory=list)  # past its grace, but nothing of ours to end it by
    gone: list[tuple[str, str]] = field(default_factory=list)  # seen before, not now
    unanswered: tuple[str, ...] = ()


def decide(seen: Observation, now: datetime) -> LeakPlan:
    """Report every leak; clean one of ours once it has been seen for the grace (and, a run, once its driver has
    been silent for the loss deadline); close the sightings of leaks no longer seen, except those
    a master that did not answer might still hold."""
    plan = LeakPlan(seen.grace_seconds, list(seen.leaks), unanswered=seen.unanswered)
    for leak in seen.leaks:
        first = seen.first_seen.get(leak.key)
        if first is None:
            plan.new.add(leak.key)
        plan.first_seen[leak.key] = first = first or now
        ready = first + timedelta(seconds=seen.grace_seconds)
        if leak.quiet_until is not None:
            ready = max(ready, leak.quiet_until)
        if not leak.ours:
            plan.reported.append(leak)
        elif ready > now:
            plan.waiting[leak.key] = round((ready - now).total_seconds(), 1)
        else:
            plan.clean.append(leak)
    seen_now = {leak.key for leak in seen.leaks}
    plan.gone = sorted(key for key in seen.first_seen if key not in seen_now
                       and not (seen.unanswered and key[0] in MASTER_KINDS))
    return plan


@dataclass
class LeakReport:
    checked_at: datetime
    grace_seconds: float
    found: list[dict[str, Any]] = field(default_factory=list)  # every leak seen now, cleaned or not
    cleaned: list[dict[str, Any]] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)  # "kind subject" of leaks that ended by themselves
    refused: list[str] = field(default_factory=list)  # cleanups that could not be done: what, why, what to do
    unanswered: list[str] = field(default_factory=list)  # versions whose masters did not answer

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "checked_at": self.checked_at.isoformat(timespec="seconds")}


def check(settings: Settings, membership: Membership, grace_seconds: float, now: datetime | None = None
          ) -> LeakReport:
    """Find leaks, record the new ones, and clean those seen for grace_seconds or more. Safe to repeat, and to run
    beside the control plane: each leak is looked at again just before it is cleaned."""
    if grace_seconds < 0:
        raise ChangeoverError("leak check", f"the grace of {grace_seconds} s is negative",
                              "pass 0 (clean at once) or more seconds")
    now = as_utc(now) if now is not None else utcnow()
    return act(settings, membership, decide(observe(settings, membership, grace_seconds), now), now)


# -- action --------------------------------------------------------------------------------------------------------

def act(settings: Settings, membership: Membership, plan: LeakPlan, now: datetime) -> LeakReport:
    """Record the new sightings and the leaks gone, then clean each leak due, one at a time: one that cannot be
    cleaned does not hold back the others, and is listed with its refusal."""
    with session_scope(settings.database_url) as s:
        for leak in plan.leaks:
            if leak.key in plan.new:
                _record(s, FOUND, leak.kind, leak.subject, now, why=leak.why, grace_seconds=plan.grace_seconds,
                        **leak.details)
        for kind, subject in plan.gone:
            _record(s, GONE, kind, subject, now, why="no longer seen: it ended by itself, or was accounted for")
    outcome: dict[tuple[str, str], str] = {}
    refused = []
    for leak in plan.clean:
        try:
            done = CLEANERS[leak.kind](settings, membership, leak, now)
        except ChangeoverError as exc:
            outcome[leak.key] = "refused"
            refused.append(f"{leak.kind} {leak.subject}: {exc}")
            continue
        outcome[leak.key] = "cleaned" if done else "gone"
        with session_scope(settings.database_url) as s:
            if done:
                _record(s, CLEANED, leak.kind, leak.subject, now, why=leak.why,
                        first_seen=plan.first_seen[leak.key].isoformat(timespec="seconds"), **leak.details)
            else:
                _record(s, GONE, leak.kind, leak.subject, now, why="no longer a leak when looked at again")
    found = [_described(plan, leak, now, outcome.get(leak.key) or ("waiting" if leak.key in plan.waiting
                                                                    else "reported")) for leak in plan.leaks]
    return LeakReport(now, plan.grace_seconds, found, [f for f in found if f["state"] == "cleaned"],
                      [f"{kind} {subject}" for kind, subject in plan.gone]
                      + [f"{f['kind']} {f['subject']}" for f in found if f["state"] == "gone"],
                      refused, list(plan.unanswered))


def _described(plan: LeakPlan, leak: Leak, now: datetime, state: str) -> dict[str, Any]:
    """state: cleaned | waiting (within its grace) | reported (not ours to end) | refused | gone (not a leak when
    looked at again)."""
    first = plan.first_seen[leak.key]
    return {"kind": leak.kind, "subject": leak.subject, "why": leak.why, "state": state, "new": leak.key in plan.new,
            "first_seen": first.isoformat(timespec="seconds"), "seen_for": round((now - first).total_seconds(), 1),
            "seconds_left": plan.waiting.get(leak.key), "details": dict(leak.details)}


def _record(s: Session, action: str, kind: str, subject: str, at: datetime, **details: Any) -> None:
    event = audit.record(s, action, kind, subject, **details)
    event.at = at  # the check's clock: the grace is measured on one clock, a test's `now` included
