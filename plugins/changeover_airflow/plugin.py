"""Registers Changeover with Airflow: its timetable (Airflow serializes only timetables a plugin declares), the
Changeover view (a FastAPI app on the api-server, in the UI's navigation). The tasks' extra links are their
operators' own (`links`): Airflow 3 computes them on the worker."""

from __future__ import annotations

import sys
from typing import Any

from airflow.plugins_manager import AirflowPlugin

from changeover_airflow.links import PREFIX
from changeover_airflow.timetables import DrainWindowTimetable

# Every Airflow process loads plugins (each task's too); only the api-server serves the view, so only it builds it.
ON_API_SERVER = "api-server" in sys.argv[1:2]


def _apps() -> list[dict[str, Any]]:
    if not ON_API_SERVER:
        return []
    from changeover_airflow.view import create_app

    return [{"app": create_app(), "url_prefix": PREFIX, "name": "Changeover"}]


class ChangeoverPlugin(AirflowPlugin):
    name = "changeover"
    timetables = [DrainWindowTimetable]
    fastapi_apps = _apps()
    external_views = [{"name": "Changeover", "href": f"{PREFIX}/", "destination": "nav", "url_route": "changeover"}]
