"""Reproduces Airflow's deferral race (apache/airflow 66374, 67287, 71580, 72716) and shows both fixes.

Each task starts a child process that outlives it, as a task that starts a Spark worker does, then
defers, then does a minute of work once resumed (a member's upgrade takes that long).
- `race`: the child inherits the task's stdin, which is a socket to the task's supervisor, so the
  task's exit is seen only a minute later, and its trigger fires at once. The stale "success" arrives
  while the resumed try runs: the scheduler kills it and marks it failed (no retries here).
- `settled`: the child keeps none of the task's sockets (as `changeover.cluster.processes.spawn` does), and the
  trigger waits 10 s first. It succeeds on its first try.
"""

import subprocess
import time
from datetime import timedelta
from typing import Any

import pendulum
from airflow.providers.standard.triggers.temporal import TimeDeltaTrigger
from airflow.sdk import DAG, BaseOperator


class DeferThenWork(BaseOperator):
    def __init__(self, *, child_holds_stdin: bool, settle_seconds: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.child_holds_stdin = child_holds_stdin
        self.settle_seconds = settle_seconds

    def execute(self, context: Any) -> None:
        stdin = None if self.child_holds_stdin else subprocess.DEVNULL
        subprocess.Popen(["sleep", "120"], stdin=stdin, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)  # ends by itself
        self.defer(trigger=TimeDeltaTrigger(timedelta(seconds=self.settle_seconds)), method_name="resume")

    def resume(self, context: Any, event: Any = None) -> None:
        time.sleep(90)  # the resumed step's own work, long enough for a stale event to arrive during it


with DAG(dag_id="deferral_race", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
         default_args={"retries": 0}, tags=["changeover-test"]):
    DeferThenWork(task_id="race", child_holds_stdin=True, settle_seconds=0)
    DeferThenWork(task_id="settled", child_holds_stdin=False, settle_seconds=10)
