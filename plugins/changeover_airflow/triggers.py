from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent
from changeover import drain, upgrade
from changeover.cluster import LocalCluster
from changeover.settings import Settings


def ready(kind: str, subject: str, settings: Settings, shutdown_timeout: int | None) -> tuple[bool, dict[str, Any]]:
    """Whether the operator has a next step to take: a small, read-mostly observation."""
    cluster = LocalCluster(settings)
    if kind == "drain":
        observed = drain.plan(settings, cluster, subject, shutdown_timeout)
        return observed.actionable, observed.as_dict()
    waiting = upgrade.jobs_stopping(settings)
    if kind == "stop":  # one job asked to stop at a batch boundary
        return subject not in waiting, {"stopping": waiting}
    return not waiting, {"stopping": waiting}


class ReconcileTrigger(BaseTrigger):
    """Polls the registry and the cluster until the operator can take its next step."""

    def __init__(
        self,
        kind: str,
        subject: str,
        settings: dict[str, str],
        shutdown_timeout: int | None = None,
        poll_interval: float = 2.0,
    ) -> None:
        super().__init__()
        self.shutdown_timeout = shutdown_timeout
        self.kind = kind
        self.subject = subject
        self.settings = settings
        self.poll_interval = poll_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "changeover_airflow.triggers.ReconcileTrigger",
            {"kind": self.kind, "subject": self.subject, "settings": self.settings,
             "shutdown_timeout": self.shutdown_timeout, "poll_interval": self.poll_interval},
        )

    async def run(self) -> AsyncIterator[TriggerEvent]:
        settings = Settings.from_env(home=self.settings["home"], database_url=self.settings["database_url"])
        last: dict[str, Any] | None = None
        while True:
            actionable, observed = await asyncio.to_thread(
                ready, self.kind, self.subject, settings, self.shutdown_timeout
            )
            if observed != last:
                self.log.info("%s %s: %s", self.kind, self.subject, observed)
                last = observed
            if actionable:
                yield TriggerEvent({"kind": self.kind, "subject": self.subject, "observed": observed})
                return
            await asyncio.sleep(self.poll_interval)
