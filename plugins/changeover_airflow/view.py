"""The Changeover view in Airflow's UI: the fleet, the jobs with their runs, moves and downtime, the savepoints, and
each upgrade's timeline. A FastAPI app the plugin mounts on the api-server under /changeover; pages are plain HTML
with inline SVG (no build step), and /changeover/api/... gives the same as JSON. It reads the registry of the
connection `changeover_default` (or ?connection=...) and changes nothing."""

from __future__ import annotations

import html
from datetime import datetime
from typing import Any

from changeover import jobs, savepoints
from changeover.cluster import membership_for, routing
from changeover.errors import ChangeoverError
from changeover.jobs import move_history
from changeover.settings import Settings
from changeover.upgrade import lock, timeline
from fastapi import Depends, FastAPI, HTTPException, Query
from fastapi.responses import HTMLResponse, RedirectResponse

from changeover_airflow.hooks import ChangeoverHook
from changeover_airflow.links import PREFIX

STYLE = """body{font-family:system-ui,sans-serif;margin:1.5rem;color:#1f2933}table{border-collapse:collapse;
margin-bottom:1.5rem}td,th{border-bottom:1px solid #d9e2ec;padding:.3rem .8rem;text-align:left;font-size:.9rem}
h1{font-size:1.4rem}h2{font-size:1.1rem;margin-top:1.5rem}.ACTIVE,.RUNNING,.SUCCEEDED,.COMPLETED{color:#18794e}
.FAILED,.KILLED{color:#c62828}svg text{font-size:11px;font-family:system-ui,sans-serif}"""
PHASE_COLOURS = {"draining": "#f0b429", "drained": "#9fb3c8", "upgrading": "#2186eb"}


def _settings(connection: str) -> Settings:
    return ChangeoverHook(connection).get_settings()


def fleet(settings: Settings) -> dict[str, Any]:
    """What the overview shows, as data."""
    status = membership_for(settings).status()
    listed = jobs.list_jobs(settings)
    for job in listed:
        job["moves"] = [{"from": m.from_version, "to": m.to_version, "kind": m.kind, "downtime": m.downtime}
                        for m in move_history.of(settings, job["name"])]
    return {"members": status["members"], "masters": status["masters"], "jobs": listed,
            "savepoints": savepoints.list_savepoints(settings), "upgrades": lock.list_upgrades(settings)}


class Html(str):
    """Markup made here (a link), put into a page as it is; every other value is escaped."""


def _cell(value: Any) -> str:
    text = str(value)
    if isinstance(value, Html):
        return f"<td>{text}</td>"
    state = f" class='{text}'" if text.isalpha() and text.isupper() else ""  # a state, coloured by the style
    return f"<td{state}>{html.escape(text)}</td>"


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(_cell(c) for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>" if rows else "<p>none</p>"


def _page(title: str, body: str) -> HTMLResponse:
    return HTMLResponse(f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
                        f"<style>{STYLE}</style></head><body>{body}</body></html>")


def _link(href: str, text: str) -> Html:
    return Html(f"<a href='{html.escape(href)}'>{html.escape(text)}</a>")


def overview_html(data: dict[str, Any]) -> str:
    members = [[m["name"], m["version"], m["status"], m["group"], m.get("host", "")] for m in data["members"]]
    masters = [[m["version"], m.get("status", ""), m["url"], _link(m["webui"], m["webui"]) if m.get("webui") else ""]
               for m in data["masters"]]
    job_rows = [[j["name"], j.get("state", ""), j.get("version", ""), len(j["moves"]),
                 "; ".join(f"{m['from']} -> {m['to']} {m['kind']}"
                           + (f" {m['downtime']:.1f} s" if m["downtime"] is not None else "") for m in j["moves"])]
                for j in data["jobs"]]
    saved = [[sp["time"], sp["job"], sp["name"], sp["spark_version"], sp["mode"], f"{sp['size_bytes'] or 0:,}"]
             for sp in data["savepoints"]]
    upgrades = [[_link(f"{PREFIX}/upgrades/{u['key']}", u["key"]), u["target_version"], u["status"], u["actor"],
                 u["started_at"]] for u in data["upgrades"]]
    return ("<h1>Changeover</h1>"
            "<h2>Fleet</h2>" + _table(["member", "version", "status", "group", "host"], members)
            + _table(["master of", "status", "url", "web UI"], masters)
            + "<h2>Jobs</h2>" + _table(["job", "state", "version", "moves", "each move, its kind and downtime"],
                                       job_rows)
            + "<h2>Upgrades</h2>" + _table(["upgrade", "target", "status", "by", "started"], upgrades)
            + "<h2>Savepoints</h2>" + _table(["taken", "job", "name", "Spark", "mode", "bytes"], saved))


def timeline_svg(line: timeline.Timeline, width: int = 1100) -> str:
    """Lanes: a member's phases as bars, a job's commits as ticks, each move as a band from the old run's last
    commit to the new run's first, labelled with its kind and downtime."""
    left, lane_height = 130, 34
    span = max((line.end - line.start).total_seconds(), 1.0)

    def x(at: datetime) -> float:
        return left + (width - left - 10) * max(0.0, min(1.0, (at - line.start).total_seconds() / span))

    lanes = sorted({s.lane for s in line.spans}) + [f"job {job}" for job in sorted(line.commits)]
    parts = []
    for index, lane in enumerate(lanes):
        y = 20 + index * lane_height
        parts.append(f"<text x='4' y='{y + 15}'>{html.escape(lane)}</text>")
        for spn in (s for s in line.spans if s.lane == lane):
            parts.append(f"<rect x='{x(spn.start):.1f}' y='{y}' width='{max(x(spn.end) - x(spn.start), 2):.1f}' "
                         f"height='20' fill='{PHASE_COLOURS.get(spn.label, '#ccc')}'><title>{spn.label}</title>"
                         f"</rect>")
        job = lane.removeprefix("job ")
        for at in line.commits.get(job, []) if lane.startswith("job ") else []:
            parts.append(f"<line x1='{x(at):.1f}' x2='{x(at):.1f}' y1='{y + 2}' y2='{y + 18}' stroke='#334e68'/>")
        for move in (m for m in line.moves if f"job {m.job}" == lane):
            end = move.first_new_commit or line.end
            parts.append(f"<rect x='{x(move.last_old_commit):.1f}' y='{y - 2}' "
                         f"width='{max(x(end) - x(move.last_old_commit), 2):.1f}' height='24' fill='#e12d39' "
                         f"fill-opacity='0.35'><title>{html.escape(move.label)}</title></rect>"
                         f"<text x='{x(move.last_old_commit):.1f}' y='{y + 31}'>{html.escape(move.label)}</text>")
    height = 30 + len(lanes) * lane_height
    axis = (f"<text x='{left}' y='{height - 2}'>{line.start:%H:%M:%S}</text>"
            f"<text x='{width - 60}' y='{height - 2}'>{line.end:%H:%M:%S}</text>")
    legend = " ".join(f"<span style='background:{c};padding:0 .4rem'>{p}</span>" for p, c in PHASE_COLOURS.items())
    return (f"<p>{legend} <span style='background:#e12d3959;padding:0 .4rem'>a move: no commit</span> "
            f"| a tick: a committed batch</p><svg width='{width}' height='{height + 4}' role='img' "
            f"aria-label='timeline of {html.escape(line.key)}'>{''.join(parts)}{axis}</svg>")


def upgrade_html(key: str, line: timeline.Timeline) -> str:
    """What an upgrade's page shows: its target and outcome, its timeline, and its moves."""
    moves = [[m.job, f"{m.last_old_commit:%H:%M:%S}", m.label] for m in line.moves]
    return (f"<p>{_link(PREFIX + '/', 'Changeover')}</p><h1>Upgrade {html.escape(key)}</h1>"
            f"<p>to Spark {html.escape(line.target_version)}: <span class='{html.escape(line.status)}'>"
            f"{html.escape(line.status)}</span>, "
            f"{line.start:%Y-%m-%d %H:%M:%S} to {line.end:%H:%M:%S} UTC</p>" + timeline_svg(line)
            + "<h2>Moves</h2>" + _table(["job", "stopped", "move"], moves))


def _guard(require_login: bool) -> list[Any]:
    """The app's dependencies: a signed-in user allowed to see plugins, unless no login is required."""
    if not require_login:
        return []
    from airflow.api_fastapi.auth.managers.models.resource_details import AccessView
    from airflow.api_fastapi.core_api.security import requires_access_view

    return [Depends(requires_access_view(AccessView.PLUGINS))]


def create_app(require_login: bool = True) -> FastAPI:
    """The app; every page needs a signed-in user allowed to see plugins (the UI's session cookie or a bearer token,
    as Airflow's own API). Only the Spark-free unit tests build it without that check, having no auth manager."""
    app = FastAPI(title="Changeover", description="The fleet, jobs, moves, savepoints and upgrade timelines",
                  dependencies=_guard(require_login))

    def load(connection: str) -> Settings:
        try:
            return _settings(connection)
        except ChangeoverError as exc:
            raise HTTPException(status_code=503, detail=str(exc)) from None

    @app.get("/", response_class=HTMLResponse)
    def overview(connection: str = Query(ChangeoverHook.default_conn_name)) -> HTMLResponse:
        return _page("Changeover", overview_html(fleet(load(connection))))

    @app.get("/api/fleet")
    def fleet_json(connection: str = Query(ChangeoverHook.default_conn_name)) -> dict[str, Any]:
        return fleet(load(connection))

    def of_upgrade(key: str, connection: str) -> timeline.Timeline:
        try:
            return timeline.of_upgrade(load(connection), key)
        except ChangeoverError as exc:
            raise HTTPException(status_code=404, detail=str(exc)) from None

    @app.get("/upgrades/{key:path}", response_class=HTMLResponse)
    def upgrade_page(key: str, connection: str = Query(ChangeoverHook.default_conn_name)) -> HTMLResponse:
        return _page(f"Upgrade {key}", upgrade_html(key, of_upgrade(key, connection)))

    @app.get("/api/upgrades/{key:path}")
    def upgrade_json(key: str, connection: str = Query(ChangeoverHook.default_conn_name)) -> dict[str, Any]:
        line = of_upgrade(key, connection)
        return {"key": line.key, "target_version": line.target_version, "status": line.status,
                "start": line.start, "end": line.end,
                "spans": [vars(s) for s in line.spans], "commits": line.commits,
                "moves": [vars(m) for m in line.moves]}

    @app.get("/master-of/{key:path}")
    def master_of_upgrade(key: str, connection: str = Query(ChangeoverHook.default_conn_name)) -> RedirectResponse:
        """The Spark master UI of the upgrade's target group (an extra link's target), or the largest group's for a
        run that is not an upgrade."""
        settings = load(connection)
        found = [u for u in lock.list_upgrades(settings) if u["key"] == key]
        version = found[0]["target_version"] if found else routing.target_version(settings)
        return master_ui(version, connection)

    @app.get("/master/{version}")
    def master_ui(version: str, connection: str = Query(ChangeoverHook.default_conn_name)) -> RedirectResponse:
        """The Spark master UI of a version group."""
        masters = {m["version"]: m for m in membership_for(load(connection)).status()["masters"]}
        if version not in masters or not masters[version].get("webui"):
            raise HTTPException(status_code=404, detail=f"no master of Spark {version} is known; running: "
                                                        f"{', '.join(sorted(masters)) or 'none'}")
        return RedirectResponse(masters[version]["webui"])

    return app
