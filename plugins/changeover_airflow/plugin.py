"""Registers Changeover with Airflow: its timetable (Airflow serializes only timetables a plugin declares), the
Changeover view (a FastAPI app on the api-server, in the UI's navigation). The tasks' extra links are their
operators' own (`links`): Airflow 3 computes them on the worker."""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from changeover_airflow.timetables import DrainWindowTimetable
from changeover_airflow.view import PREFIX, create_app


class ChangeoverPlugin(AirflowPlugin):
    name = "changeover"
    timetables = [DrainWindowTimetable]
    fastapi_apps = [{"app": create_app(), "url_prefix": PREFIX, "name": "Changeover"}]
    external_views = [{"name": "Changeover", "href": f"{PREFIX}/", "destination": "nav", "url_route": "changeover"}]

