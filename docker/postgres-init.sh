#!/bin/bash
# One server, two databases: Airflow's metadata and Changeover's registry, each with its own role.
set -euo pipefail
psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" <<SQL
CREATE ROLE airflow LOGIN PASSWORD '${AIRFLOW_DB_PASSWORD}';
CREATE DATABASE airflow OWNER airflow;
CREATE ROLE changeover LOGIN PASSWORD '${CHANGEOVER_DB_PASSWORD}';
CREATE DATABASE changeover OWNER changeover;
SQL
