"""The production-like docker-compose.yaml, checked for its structure: this machine has no Docker engine, so it is
never run here (docs/operations.md says so). What is checked is what would break a deployment silently: the
services Airflow 3 needs, auth without an anonymous admin, both Spark versions from the official images, the
shared volume at one path everywhere, and a cluster file that Changeover itself accepts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from changeover.cluster import platform
from changeover.cluster.runtimes import SUPPORTED_VERSIONS
from changeover.settings import CHECKOUT

COMPOSE = CHECKOUT / "docker-compose.yaml"
AIRFLOW_SERVICES = {"airflow-apiserver": "api-server", "airflow-scheduler": "scheduler",
                    "airflow-dag-processor": "dag-processor", "airflow-triggerer": "triggerer"}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    return {volume.split(":")[1]: volume.split(":")[0] for volume in service.get("volumes", [])}


def test_airflow_runs_its_four_processes_on_postgres_after_both_migrations(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for name, command in AIRFLOW_SERVICES.items():
        service = services[name]
        assert service["command"] == command and "healthcheck" in service, name
        assert service["depends_on"]["airflow-init"]["condition"] == "service_completed_successfully"
        assert service["depends_on"]["postgres"]["condition"] == "service_healthy"
        env = service["environment"]
        assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("postgresql+psycopg://")
        assert env["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor"
    init = " ".join(services["airflow-init"]["command"])
    assert "airflow db migrate" in init and "changeover db upgrade" in init
    assert services["postgres"]["image"].startswith("postgres:") and "healthcheck" in services["postgres"]
    init_sql = (CHECKOUT / "docker" / "postgres-init.sh").read_text()
    assert "CREATE DATABASE airflow" in init_sql and "CREATE DATABASE changeover" in init_sql


def test_auth_is_on_and_no_user_is_an_anonymous_admin(compose: dict[str, Any]) -> None:
    env = compose["services"]["airflow-apiserver"]["environment"]
    assert env["AIRFLOW__CORE__AUTH_MANAGER"].endswith("SimpleAuthManager")
    assert env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS"] == "false"
    text = COMPOSE.read_text()
    for secret in ("POSTGRES_PASSWORD", "AIRFLOW_DB_PASSWORD", "CHANGEOVER_DB_PASSWORD", "SPARK_REST_KEY"):
        assert f"${{{secret}:?" in text, f"{secret} has no default: the file refuses to start without it"
    connection = env["AIRFLOW_CONN_CHANGEOVER_DEFAULT"]
    assert '"password": "${CHANGEOVER_DB_PASSWORD' in connection  # masked by Airflow, not in the URL
    assert "changeover@postgres/changeover" in connection


def test_spark_masters_and_members_of_two_versions_come_from_the_official_images(compose: dict[str, Any]) -> None:
    services = compose["services"]
    dockerfile = (CHECKOUT / "docker" / "spark.Dockerfile").read_text()
    assert "FROM apache/spark:${SPARK_VERSION}-python3" in dockerfile
    versions = {services[f"spark-master-{v}"]["build"]["args"]["SPARK_VERSION"] for v in ("4.2.0", "4.3.0")}
    assert versions == {"4.2.0", "4.3.0"} <= set(SUPPORTED_VERSIONS)
    for member in ("m1", "m2", "m3"):
        for version in versions:
            worker = services[f"worker-{member}-{version}"]
            assert worker["image"] == f"changeover-spark:{version}" and worker["hostname"] == f"worker-{member}"
            assert worker["command"][-1] == f"spark://spark-master-{version}:7077"
            assert worker["profiles"] == ["members"]  # one version per member runs, started by its template
    rest = services["spark-master-4.2.0"]["environment"]["SPARK_MASTER_OPTS"]
    assert "JWSFilter" in rest and "spark.master.rest.enabled=true" in rest


def test_checkpoints_and_savepoints_are_one_volume_at_one_path_for_airflow_and_spark(
        compose: dict[str, Any]) -> None:
    services = compose["services"]
    sharing = [name for name in services if name.startswith(("airflow-", "spark-", "worker-"))]
    assert all(_mounts(services[name]).get("/changeover") == "changeover-home" for name in sharing)
    assert "changeover-home" in compose["volumes"]


def test_the_cluster_file_it_names_is_one_changeover_accepts(compose: dict[str, Any], tmp_path: Path) -> None:
    spec = platform.load(CHECKOUT / "docker" / "cluster.json")
    assert set(spec.masters) == {"4.2.0", "4.3.0"} and set(spec.members) == {"m1", "m2", "m3"}
    services = compose["services"]
    for version, master in spec.masters.items():
        assert services[f"spark-master-{version}"]["hostname"] in master.url
    start = spec.command("start_worker", "m2", "4.3.0")
    assert start is not None and start.endswith("up --detach --no-deps worker-m2-4.3.0")
    assert "worker-m2-4.3.0" in services
    mounted = _mounts(services["airflow-scheduler"])
    assert mounted["/opt/changeover/docker"] == "./docker" and "/var/run/docker.sock" in mounted
