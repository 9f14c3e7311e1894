"""Credentials by reference: the registry URL reaches child processes as a file only this user reads, never in
their environment; triggers carry no URL; the Airflow hook masks the password. No process is started here: the
end-to-end run on PostgreSQL checks the same in real task logs and drivers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from changeover.settings import Settings

URL = "postgresql+psycopg://app:s3cret-pw@127.0.0.1:5432/registry"


def test_child_processes_get_the_registry_url_by_a_private_file(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings.from_env(home=tmp_path, database_url=URL)
    env = settings.as_env()
    assert not any("s3cret-pw" in value for value in env.values()), env
    reference = Path(env["CHANGEOVER_DATABASE_URL_FILE"])
    assert oct(reference.stat().st_mode & 0o777) == "0o600" and reference.read_text() == URL

    monkeypatch.delenv("CHANGEOVER_DATABASE_URL", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert Settings.from_env().database_url == URL  # what a driver or a CLI child reads


def test_a_trigger_carries_no_registry_url() -> None:
    from changeover_airflow.triggers import ReconcileTrigger

    # it reads the registry's URL from its connection in the triggerer, as the task does
    _path, kwargs = ReconcileTrigger("stable", "clicks", {"savepoint": "update-1", "batches": 5}).serialize()
    assert "s3cret-pw" not in json.dumps(kwargs) and "postgresql" not in json.dumps(kwargs)
    assert ReconcileTrigger(**kwargs).serialize()[1] == kwargs  # the triggerer rebuilds it from what was stored
    older = {"kind": "roll", "subject": "dag/run", "settings": {"home": "/x"}, "shutdown_timeout": None}
    assert ReconcileTrigger(**older).params == {}  # one stored by the release before still runs


def test_the_hook_puts_the_connections_password_into_the_url_and_masks_it(tmp_path: Path) -> None:
    from airflow.sdk._shared.secrets_masker import _secrets_masker
    from changeover_airflow.hooks import ChangeoverHook

    bare = "postgresql+psycopg://app@127.0.0.1:5432/registry"
    assert ChangeoverHook.registry_url({"database_url": bare}, "s3cret-pw") == URL
    (tmp_path / "url").write_text(bare + "\n")
    assert ChangeoverHook.registry_url({"database_url_file": str(tmp_path / "url")}, "s3cret-pw") == URL
    sqlite = f"sqlite:///{tmp_path / 'registry.db'}"
    assert ChangeoverHook.registry_url({"database_url": sqlite}, "s3cret-pw") == sqlite

    ChangeoverHook._mask(URL)
    assert "s3cret-pw" not in _secrets_masker().redact(f"connecting to {URL}")


def test_a_keyed_tables_description_keeps_no_password_and_the_control_plane_fills_in_the_registrys() -> None:
    from changeover.runtime import KeyedTable
    from changeover.runtime.sinks import from_description

    registry = "postgresql+psycopg://app:s3cret@db.example:5432/registry"
    described = KeyedTable(registry, "clicks_totals", keys=("key",)).describe()
    assert "s3cret" not in json.dumps(described)  # kept in job_runs.sinks and in savepoint manifests
    assert described["url"] == "postgresql+psycopg://app@db.example:5432/registry"
    rebuilt = from_description(described, registry)
    assert isinstance(rebuilt, KeyedTable) and rebuilt.url == registry
    # Another server's (or user's) sink gets no password of the registry's: its driver finds its own (PGPASSFILE).
    elsewhere = KeyedTable("postgresql+psycopg://app:other@sinks.example/warehouse", "t", keys=("k",)).describe()
    assert from_description(elsewhere, registry).url == "postgresql+psycopg://app@sinks.example/warehouse"
    assert from_description(described).url == described["url"]
    sockets = "postgresql+psycopg://app:pw@/registry?host=/run/a", "postgresql+psycopg://app@/warehouse?host=/run/b"
    assert "pw" not in from_description(KeyedTable(sockets[1], "t", keys=("k",)).describe(), sockets[0]).url
    implicit_port = KeyedTable("postgresql+psycopg://app@db.example/registry", "t", keys=("k",)).describe()
    assert from_description(implicit_port, registry).url == "postgresql+psycopg://app:s3cret@db.example/registry"


def test_the_connection_param_chooses_a_platforms_cluster_for_every_task(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's `connection` Param names the connection every task's hook reads; one with a cluster file gives the
    platform's standalone cluster (its whole roll through the scheduler is tests/e2e's, under `make test-e2e`)."""
    from airflow.dag_processing.dagbag import DagBag
    from changeover.cluster import membership_for
    from changeover.cluster.standalone import StandaloneCluster
    from changeover.registry.schema import migrate
    from changeover_airflow.hooks import ChangeoverHook

    cluster_file = tmp_path / "cluster.json"
    cluster_file.write_text(json.dumps({
        "masters": {"4.2.0": {"url": "spark://m:7077", "rest_url": "http://m:6066", "webui_url": "http://m:8080"}},
        "members": {"w1": {"host": "10.0.0.11", "worker_ui": "http://10.0.0.11:8081"}},
        "commands": {"start_worker": "ssh {host} start", "stop_worker": "ssh {host} stop"},
        "spark_home": "/opt/spark-{version}", "python": "/opt/spark-{version}/venv/bin/python"}))
    extra = {"home": str(tmp_path / "home"), "database_url": f"sqlite:///{tmp_path / 'registry.db'}",
             "cluster_file": str(cluster_file)}
    migrate(extra["database_url"])
    monkeypatch.setenv("AIRFLOW_CONN_CHANGEOVER_PLATFORM", json.dumps({"conn_type": "changeover", "extra": extra}))
    settings = ChangeoverHook("changeover_platform").get_settings()
    assert settings.cluster_file == cluster_file and isinstance(membership_for(settings), StandaloneCluster)

    dag = DagBag(str(Path(__file__).parent.parent / "dags")).dags["rolling_upgrade"]
    conn_ids = {task.task_id: getattr(task, "changeover_conn_id", None) for task in dag.tasks}
    assert {conn_ids[t] for t in ("preflight", "compatibility", "roll", "rebalance", "verify", "finish")} == {
        "{{ params.connection }}"}, conn_ids
