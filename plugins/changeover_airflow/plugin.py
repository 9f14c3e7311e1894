"""Registers Changeover's timetable with Airflow, which serializes only timetables that a plugin declares."""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from changeover_airflow.timetables import DrainWindowTimetable


class ChangeoverPlugin(AirflowPlugin):
    name = "changeover"
    timetables = [DrainWindowTimetable]
