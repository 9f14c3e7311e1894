from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent
from changeover import audit
from changeover.cluster import membership_for
from changeover.cluster.spark_master import MasterUnreachable
from changeover.settings import Settings
from changeover.upgrade import code_update, member_upgrade, roll
from changeover.upgrade.zero_downtime import CatchUp

# A deferring task's worker reports its own exit after it defers. A trigger that fires before the
# scheduler has taken that report in makes it see a stale "success" and retry the task (apache/airflow
# 66374, 67287, 71580, 72716). Waiting this long first leaves the scheduler time to settle.
SETTLE_SECONDS = 10.0


def ready(kind: str, subject: str, settings: Settings, shutdown_timeout: int | None,
          params: dict[str, Any] | None = None) -> tuple[bool, dict[str, Any]]:
    """Whether the operator has a next step to take: a small, read-mostly observation. A master that does not
    answer is no news: the trigger keeps polling rather than failing the task."""
    try:
        return _ready(kind, subject, settings, shutdown_timeout, params or {})
    except MasterUnreachable as exc:
        return False, {"unanswered": str(exc)}


def _ready(kind: str, subject: str, settings: Settings, shutdown_timeout: int | None,
           params: dict[str, Any]) -> tuple[bool, dict[str, Any]]:
    if kind == "roll":
        status = roll.observe(settings, membership_for(settings), subject, shutdown_timeout)
        return status.drain is None or status.drain.actionable, status.as_dict()
    if kind == "stable":  # a job on new code: stable, or its run ended, decides the gate
        result = code_update.stability(settings, membership_for(settings), subject, params["savepoint"],
                                  int(params["batches"]), float(params["max_lag_seconds"]), params.get("renames") or {})
        return result.stable or result.ended, {"stable": result.stable, "reason": result.reason}
    if kind == "follow":  # a zero-downtime update: its follower starts, catches up, or is due to take over
        due = code_update.cut_over_due(settings, membership_for(settings), subject,
                                       CatchUp(**params.get("catch_up", {})))
        return due, {"cut_over_due": due}
    waiting = member_upgrade.jobs_stopping(settings)
    if kind == "stop":  # one job asked to stop at a batch boundary
        return subject not in waiting, {"stopping": waiting}
    return not waiting, {"stopping": waiting}


class ReconcileTrigger(BaseTrigger):
    """Polls the registry and the cluster until the operator can take its next step.

    It carries no credentials: the registry's URL comes from the triggerer's own `changeover_default`
    connection or environment, like the task's.
    """

    def __init__(
        self,
        kind: str,
        subject: str,
        params: dict[str, Any] | None = None,
        shutdown_timeout: int | None = None,
        poll_interval: float = 2.0,
        settle_seconds: float = SETTLE_SECONDS,
        conn_id: str = "changeover_default",
        fire_by: float | None = None,
        acting: dict[str, str | None] | None = None,
        settings: dict[str, str] | None = None,  # written by Changeover before 2026-11-26; unused
    ) -> None:
        super().__init__()
        self.acting = acting  # the deferring task's actor and upgrade, for the events its polls write
        self.shutdown_timeout = shutdown_timeout
        self.kind = kind
        self.subject = subject
        self.params = params or {}  # what the observation of this kind needs beyond its subject
        self.poll_interval = poll_interval
        self.settle_seconds = settle_seconds
        self.conn_id = conn_id
        self.fire_by = fire_by  # epoch seconds: fire then at the latest (a drain window's close)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "changeover_airflow.triggers.ReconcileTrigger",
            {"kind": self.kind, "subject": self.subject, "params": self.params,
             "shutdown_timeout": self.shutdown_timeout, "poll_interval": self.poll_interval,
             "settle_seconds": self.settle_seconds, "conn_id": self.conn_id, "fire_by": self.fire_by,
             "acting": self.acting},
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from changeover_airflow.hooks import ChangeoverHook

        if self.acting:  # this trigger's own asyncio task: to_thread carries it into the polls' threads
            audit.act_as(audit.Acting(str(self.acting["actor"]), self.acting.get("upgrade")))
        settings = await asyncio.to_thread(ChangeoverHook(self.conn_id).get_settings)
        earliest = time.monotonic() + self.settle_seconds
        last: dict[str, Any] | None = None
        while True:
            actionable, observed = await asyncio.to_thread(
                ready, self.kind, self.subject, settings, self.shutdown_timeout, self.params
            )
            if observed != last:
                self.log.info("%s %s: %s", self.kind, self.subject, observed)
                last = observed
            due = self.fire_by is not None and time.time() >= self.fire_by
            if (actionable or due) and time.monotonic() >= earliest:
                yield TriggerEvent({"kind": self.kind, "subject": self.subject, "observed": observed})
                return
            await asyncio.sleep(self.poll_interval)
