"""A team's existing batch application, submitted with the Spark provider's `SparkSubmitOperator` arguments but
routed by Changeover: to the master of the largest version group, in cluster deploy mode through the master's REST
API, registered as a Changeover job so that drains respect its `block_shutdown` or shutdown timeout.

The provider's own submission would go to whatever master its connection names, even a group being drained, and
its status polling of standalone drivers fails on Airflow 3.3.1 (apache/airflow#71881). Here the driver's status is
followed over the master's REST API by Changeover's observation of the run, and `on_kill` kills the driver there.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from changeover import jobs
from changeover.cluster import membership_for
from changeover.cluster.spark_settings import SparkSettings
from changeover.errors import ChangeoverError
from changeover.registry.db import session_scope
from changeover.registry.models import Job, JobRun
from changeover.settings import Settings
from changeover.timeutil import as_utc

from changeover_airflow.hooks import ChangeoverHook
from changeover_airflow.operators import acting_settings


def _listed(value: str | None) -> list[str]:
    return [part for part in (value or "").split(",") if part]


class RoutedSparkSubmitOperator(SparkSubmitOperator):
    """`SparkSubmitOperator` arguments (application, name, conf, executor and driver resources, py_files, jars,
    packages), submitted as Changeover job `name`. Waits until the driver ends: FINISHED passes, anything else fails
    with the driver's error. A retry follows the run it launched, and one whose run finished during this DAG run is
    not submitted again. Arguments that make sense only for spark-submit's own client (keytab, yarn, k8s) are
    refused rather than ignored."""

    template_fields: Sequence[str] = (*SparkSubmitOperator.template_fields, "changeover_conn_id")
    # spark-submit client options with no place in a REST submission of a Python driver here; given, they are
    # refused by name rather than ignored
    _UNSUPPORTED = ("_archives", "_yarn_queue", "keytab", "principal", "proxy_user", "_num_executors",
                    "application_args", "files", "_java_class", "env_vars", "driver_class_path", "exclude_packages",
                    "_repositories", "properties_file")

    def __init__(self, *, block_shutdown: bool = False, shutdown_timeout: int = 30,
                 changeover_conn_id: str = ChangeoverHook.default_conn_name, **kwargs: Any) -> None:
        self._named = "name" in kwargs  # unnamed, the job is named after the DAG and task, at execute
        super().__init__(**kwargs)
        self.block_shutdown, self.shutdown_timeout = block_shutdown, shutdown_timeout
        self.changeover_conn_id = changeover_conn_id
        self._settings: Settings | None = None

    def _spark_settings(self) -> SparkSettings:
        given = [name.strip("_") for name in self._UNSUPPORTED if getattr(self, name, None)]
        if given or self._deploy_mode not in (None, "cluster"):
            raise ChangeoverError(f"spark-submit arguments {', '.join(given) or 'deploy_mode'} of task {self.task_id}",
                                  "Changeover submits through the Spark master's REST API in cluster mode, where they "
                                  "do not apply", "leave them out (resources and confs go through conf and the "
                                  "executor and driver arguments)")
        return SparkSettings(executor_cores=self._executor_cores or 1, executor_memory=self._executor_memory or "1g",
                             driver_memory=self._driver_memory or "1g", cores_max=self._total_executor_cores,
                             extra_confs={str(k): str(v) for k, v in (self.conf or {}).items()},
                             py_files=tuple(_listed(self.py_files)), jars=tuple(_listed(self.jars)),
                             packages=tuple(_listed(self.packages)))

    def execute(self, context: Any) -> dict[str, Any]:
        if not self._named:  # the provider's default name would make every unnamed task one job
            self.name = f"{context['ti'].dag_id}.{context['ti'].task_id}"
        settings = self._settings = acting_settings(context, self.changeover_conn_id, upgrade_step=False)
        membership = membership_for(settings)
        spark = self._spark_settings()
        spark.check()
        run = self._launched_in_this_dag_run(settings, context)
        if run is None:
            run = jobs.submit(settings, membership, self.application, self.name, fault_tolerant=False,
                              block_shutdown=self.block_shutdown, shutdown_timeout=self.shutdown_timeout,
                              options={"spark": asdict(spark)})
            self.log.info("job %s: run %s submitted to the Spark %s group as %s", self.name, run.id,
                          run.spark_version, run.submission_id)
        while run.state in jobs.LIVE:
            time.sleep(self._status_poll_interval)
            run = jobs.refresh(settings, membership, self.name) or run
        outcome = {"job": self.name, "run": run.id, "spark_version": run.spark_version, "state": run.state}
        if run.state != "FINISHED":
            raise ChangeoverError(f"batch application {self.application} (job {self.name}, run {run.id})",
                                  f"its driver ended {run.state}: {run.error or 'no error recorded'}",
                                  "read the driver's log on its worker, fix the application, and clear the task")
        return outcome

    def _launched_in_this_dag_run(self, settings: Settings, context: Any) -> JobRun | None:
        """The job's current run if this DAG run launched it (a retry follows it, or finds it FINISHED and does not
        run the application twice); None when the application is to be submitted. A cleared task of the same DAG
        run is no new request: trigger a new DAG run to run the application again."""
        with session_scope(settings.database_url) as s:
            job = s.get(Job, self.name)
            run = s.get(JobRun, job.current_run_id) if job is not None and job.current_run_id else None
        dag_run = context.get("dag_run")
        began = as_utc(dag_run.start_date) if dag_run is not None and dag_run.start_date else None
        if run is not None and run.state in jobs.LIVE and (began is None or as_utc(run.submitted_at) < began):
            raise ChangeoverError(f"batch application {self.application} as job {self.name}",
                                  f"the job's run {run.id} is still {run.state}, launched before this DAG run",
                                  "let it finish (or cancel it: `changeover jobs`), or give this task another name")
        if run is None or began is None or as_utc(run.submitted_at) < began:
            return None
        if run.state in jobs.LIVE or run.state == "FINISHED":
            return jobs.refresh(settings, membership_for(settings), self.name)
        return None  # it failed or was killed: the retry submits the application again

    def on_kill(self) -> None:
        """The task was killed: the driver goes too, through its master."""
        settings = self._settings
        if settings is None:
            return
        with session_scope(settings.database_url) as s:
            known = s.get(Job, self.name) is not None
        if known:
            jobs.cancel(settings, membership_for(settings), self.name, reason=f"task {self.task_id} was killed")
