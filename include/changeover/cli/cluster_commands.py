"""`changeover db`, `cluster` and `runtime`: the registry's schema, the local Spark cluster, its runtimes."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from changeover.cli.app import JsonFlag, checked_settings, cluster_app, db_app, emit, out, plain_settings, runtime_app


@db_app.command("upgrade")
def db_upgrade() -> None:
    """Bring the registry to this version's schema (Airflow's tasks refuse a registry that is not there)."""
    from sqlalchemy.engine import make_url

    from changeover.registry.schema import migrate

    settings = plain_settings()
    migrate(settings.database_url)
    out().print(f"registry schema current at {make_url(settings.database_url).render_as_string(hide_password=True)}")


@cluster_app.command("up")
def cluster_up(
    members: Annotated[str, typer.Option(help="Comma-separated member names.")] = "m1,m2,m3",
    version: Annotated[str, typer.Option(help="Spark version of the new members.")] = "4.2.0",
    master_port: Annotated[int | None, typer.Option(help="Port of a new master; free one if unset.")] = None,
    light_jobs: Annotated[bool, typer.Option("--light-jobs/--no-light-jobs",
                                             help="Each member also runs a Spark Connect server for light jobs "
                                                  "(`changeover sql`).")] = False,
) -> None:
    """Start a master per version group and a worker per member."""
    from changeover.cluster import membership_for

    specs = [(name.strip(), version) for name in members.split(",") if name.strip()]
    membership_for(checked_settings()).up(specs, master_port, light_jobs=light_jobs)
    cluster_status(as_json=False)


@cluster_app.command("down")
def cluster_down() -> None:
    """Stop every Spark process this cluster folder started, also after a crash."""
    from changeover.cli import sql_agent
    from changeover.cluster import membership_for

    settings = plain_settings()
    sql_agent.stop_all(settings)  # its sessions were on this cluster's Connect servers
    stopped = membership_for(settings).down()
    out().print(f"stopped: {', '.join(stopped) or 'nothing was running'}")


@cluster_app.command("status")
def cluster_status(as_json: JsonFlag = False) -> None:
    """Members: name, version, status, group; and the masters."""
    from changeover.cluster import membership_for

    status = membership_for(checked_settings()).status()
    if as_json:
        print(json.dumps(status, indent=2))
        return
    emit(status["members"], False, [("NAME", "name"), ("VERSION", "version"), ("STATUS", "status"),
                                    ("GROUP", "group"), ("HOST", "host"), ("RUNNING", "running"),
                                    ("CONNECT", "connect")])
    emit(status["masters"], False, [("GROUP", "version"), ("MASTER", "url"), ("WEB UI", "webui"),
                                    ("RUNNING", "running")])


@runtime_app.command("install")
def runtime_install(version: str) -> None:
    """Install the Spark runtime of a version (idempotent)."""
    from changeover.cluster.runtimes import install_runtime

    runtime = install_runtime(plain_settings().runtimes_dir, version)
    out().print(f"Spark {version} runtime at {runtime.root}")


@runtime_app.command("list")
def runtime_list(as_json: JsonFlag = False) -> None:
    """The supported Spark versions, and which are installed."""
    from changeover.cluster.runtimes import SUPPORTED_VERSIONS, installed_versions

    installed = installed_versions(plain_settings().runtimes_dir)
    rows = [{"version": v, "installed": v in installed} for v in SUPPORTED_VERSIONS]
    emit(rows, as_json, [("VERSION", "version"), ("INSTALLED", "installed")])
