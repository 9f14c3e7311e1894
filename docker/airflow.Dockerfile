# Airflow with Changeover: the official image, the project's pinned requirements and core (the DAGs and plugins
# are mounted by the compose file), and the
# Docker CLI the member templates of docker/cluster.json call. Built by docker-compose.yaml (not run on the
# development machines, which have no Docker engine).
FROM apache/airflow:3.3.2-python3.11
USER root
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends docker.io openjdk-17-jre-headless \
    && rm -rf /var/lib/apt/lists/*
USER airflow
COPY --chown=airflow:root requirements.txt pyproject.toml /opt/changeover/
COPY --chown=airflow:root include /opt/changeover/include
RUN pip install --no-cache-dir -r /opt/changeover/requirements.txt && pip install --no-cache-dir --no-deps /opt/changeover
