"""A job that writes through the user's own foreachBatch function: per-batch counts per key into its own table.

The function is idempotent: it replaces the rows of its batch id in one transaction, so a replayed batch writes
the same rows again. It also refuses to write for an epoch older than one that already wrote, in that same
transaction, so a superseded run cannot land a batch even if it slipped past Changeover's own fence.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from changeover.runtime import ForeachBatch, JobContext, Stage
from pyspark.sql.types import LongType, StringType, StructField, StructType, TimestampType

SCHEMA = StructType([StructField("key", StringType()), StructField("ts", TimestampType()),
                     StructField("seq", LongType())])
METADATA = sa.MetaData()
COUNTS = sa.Table("click_audit_counts", METADATA, sa.Column("batch_id", sa.BigInteger, primary_key=True),
                  sa.Column("key", sa.String(100), primary_key=True), sa.Column("events", sa.BigInteger),
                  sa.Column("epoch", sa.BigInteger))
EPOCHS = sa.Table("click_audit_epochs", METADATA, sa.Column("job", sa.String(100), primary_key=True),
                  sa.Column("epoch", sa.BigInteger))


class StaleEpoch(RuntimeError):
    pass


def writer(url: str, job: str) -> Any:
    """Epochs are per job: each job's epoch grows with its own changes of ownership."""

    def write(batch: Any, batch_id: int, epoch: int) -> None:
        rows = [r.asDict() for r in batch.groupBy("key").count().collect()]  # a dozen keys: small
        engine = sa.create_engine(url)
        METADATA.create_all(engine, checkfirst=True)
        with engine.begin() as connection:
            newest = connection.scalar(sa.select(EPOCHS.c.epoch).where(EPOCHS.c.job == job).with_for_update())
            if newest is not None and newest > epoch:
                raise StaleEpoch(f"job {job}: epoch {epoch} is older than {newest}, which already wrote")
            connection.execute(sa.delete(EPOCHS).where(EPOCHS.c.job == job))
            connection.execute(sa.insert(EPOCHS).values(job=job, epoch=max(epoch, newest or 0)))
            connection.execute(sa.delete(COUNTS).where(COUNTS.c.batch_id == batch_id))
            if rows:
                connection.execute(sa.insert(COUNTS), [{"batch_id": batch_id, "key": r["key"],
                                                        "events": r["count"], "epoch": epoch} for r in rows])
        engine.dispose()

    return write


def totals(url: str) -> dict[str, int]:
    engine = sa.create_engine(url)
    if not sa.inspect(engine).has_table(COUNTS.name):
        return {}
    with engine.connect() as connection:
        found = connection.execute(sa.select(COUNTS.c.key, sa.func.sum(COUNTS.c.events)).group_by(COUNTS.c.key))
        return {key: int(total) for key, total in found}


def build(spark: Any, ctx: JobContext) -> list[Stage]:
    events = spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 20).json(ctx.options["landing"])
    sink = ForeachBatch(writer(ctx.options["audit_url"], ctx.job), guarantee="idempotent")
    return [Stage("audit", events, sink, "append", ctx.options.get("trigger", "1 second"))]
