"""Scheduled maintenance: in each drain window, drain and upgrade the members marked for maintenance, in order.

Airflow runs the latest past window at once when catchup is off, so the roll task itself checks the
window: no member's drain starts outside it, and a drain the window closes on is undone (the member
is left ACTIVE, with the reason recorded).
"""

import os

import pendulum
from airflow.sdk import DAG, Param
from changeover_airflow.chains import UPGRADE_DEFAULT_ARGS, upgrade_chain, upgrade_params
from changeover_airflow.timetables import DrainWindowTimetable

WINDOW = os.environ.get("CHANGEOVER_DRAIN_WINDOW", "SUN 02:00-04:00")

with DAG(
    dag_id="drain_window",
    description=f"Drain and upgrade the members marked for maintenance, only inside {WINDOW} UTC",
    schedule=DrainWindowTimetable(WINDOW),
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    render_template_as_native_obj=True,
    default_args=UPGRADE_DEFAULT_ARGS,
    params=upgrade_params(
        "Spark version for the marked members.",
        drain_needs_seconds=Param(900, type="integer", minimum=0,
                                  description="A member's drain starts only with this much of the window left."),
    ),
    tags=["changeover"],
):
    upgrade_chain(marked_only=True, window=WINDOW, drain_needs_seconds="{{ params.drain_needs_seconds }}")
