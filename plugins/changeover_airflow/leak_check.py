"""The leak checker's operator, thin over `changeover.housekeeping.leaks`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from changeover.errors import NeedsOperator
from changeover.housekeeping import leaks

from changeover_airflow.operators import ChangeoverOperator


class LeakCheckOperator(ChangeoverOperator):
    """Finds runs, light jobs, drivers, applications, PID files and staging folders the registry and Spark disagree
    on, and cleans each once it has been seen for `grace_seconds`. The report is the task's return value; a cleanup
    that was refused fails the task once the others are done, since a retry meets the same refusal."""

    template_fields: Sequence[str] = ("changeover_conn_id", "grace_seconds")

    def __init__(self, *, grace_seconds: Any = 600, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.grace_seconds = grace_seconds

    def execute(self, context: Any) -> dict[str, Any]:
        settings, cluster = self._setup(context)
        report = leaks.check(settings, cluster, float(self.grace_seconds))
        for leak in report.found:
            self.log.info("leak %s %s: %s (%s, seen for %s s)", leak["kind"], leak["subject"], leak["state"],
                          leak["why"], leak["seen_for"])
        self.log.info("leak check: %d found, %d cleaned", len(report.found), len(report.cleaned))
        if report.unanswered:
            self.log.warning("masters that did not answer, their drivers left for the next check: %s",
                             ", ".join(report.unanswered))
        if report.refused:
            from airflow.sdk.exceptions import AirflowFailException

            context["ti"].xcom_push(key="report", value=report.as_dict())
            refusal = NeedsOperator("leak cleanup", "; ".join(report.refused),
                                    "act as each refusal says; the next check cleans the rest")
            raise AirflowFailException(str(refusal)) from refusal
        return report.as_dict()
