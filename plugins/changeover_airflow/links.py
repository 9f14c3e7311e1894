"""Extra links from a task to the Changeover view: its upgrade's timeline, and the Spark master UI of the upgrade's
target group. The links name only the run; the view resolves the rest, so nothing here reads the registry."""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseOperatorLink

PREFIX = "/changeover"


def _base() -> str:
    """The UI's own base URL when it is served under a path ([api] base_url), so the links stay inside it."""
    from airflow.configuration import conf

    return (conf.get("api", "base_url", fallback="") or "").rstrip("/")


class ChangeoverViewLink(BaseOperatorLink):
    name = "Changeover"

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        if getattr(operator, "upgrade_step", False):
            return f"{_base()}{PREFIX}/upgrades/{ti_key.dag_id}/{ti_key.run_id}"
        return f"{_base()}{PREFIX}/"


class SparkMasterLink(BaseOperatorLink):
    name = "Spark master"

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        return f"{_base()}{PREFIX}/master-of/{ti_key.dag_id}/{ti_key.run_id}"
