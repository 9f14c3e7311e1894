# A Spark standalone master or worker of one version: the official Apache Spark image, with what Changeover's
# drivers need beside pyspark (they run on the workers, in cluster deploy mode): SQLAlchemy and the registry's
# PostgreSQL driver.
ARG SPARK_VERSION=4.2.0
FROM apache/spark:${SPARK_VERSION}-python3
USER root
RUN pip install --no-cache-dir sqlalchemy==2.1.9 psycopg==3.3.9 psycopg-binary==3.3.9
USER spark
