"""A keyed SQL table (PostgreSQL or SQLite) of any schema: exactly once through a ledger, rewindable through undo.

A batch is never collected on the driver. Each partition writes its rows (`COPY` on PostgreSQL, batched inserts
elsewhere) into a staging table from the executor that holds it, tagged with its task attempt; the driver collects
only which attempt of each partition Spark accepted (a retried task, a speculative copy or a zombie attempt may
have staged too). Then one transaction on the driver, inside the fence, merges those attempts' rows into the
table as upserts on the declared key columns, keeps the rows they replace in an undo table, and writes the
batch's ledger entry. A batch already in the ledger is skipped, so a replayed batch changes nothing; rewinding
to a savepoint's batch applies the undo entries of later batches, newest first, so the table holds its values as
of that batch.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Engine

from changeover import faults
from changeover.errors import ChangeoverError
from changeover.handoff import fence
from changeover.names import check_name
from changeover.registry.db import engine_for, patiently
from changeover.registry.models import SinkLedger
from changeover.runtime.sinks.base import Sink, WriteContext, foreach_batch, run_without_writing

OWNER, BATCH, RUN, PART, ATTEMPT = "_co_owner", "_co_batch", "_co_run", "_co_part", "_co_attempt"
EXISTED = "_co_existed"
EPOCHS = "co_sink_epochs"  # in the sink's own database: the newest fencing epoch that merged, per job
_SPARK_TYPES: dict[str, Any] = {
    "string": sa.Text, "long": sa.BigInteger, "integer": sa.Integer, "short": sa.SmallInteger,
    "byte": sa.SmallInteger, "double": sa.Float, "float": sa.Float, "boolean": sa.Boolean,
    "timestamp": lambda: sa.DateTime(timezone=True), "timestamp_ntz": sa.DateTime, "date": sa.Date,
    "binary": sa.LargeBinary,
}
_tables_lock = threading.Lock()


def _sql_type(field: Any) -> Any:
    name = field.dataType.typeName()
    if name == "decimal":
        return sa.Numeric(field.dataType.precision, field.dataType.scale)
    if name not in _SPARK_TYPES:
        raise ChangeoverError(f"column {field.name!r} of type {field.dataType.simpleString()}",
                              "a keyed table stores flat columns only",
                              "select flat columns before the sink, e.g. window.start AS window_start")
    return _SPARK_TYPES[name]()


def without_password(url: str) -> str:
    # URL is a NamedTuple; its set() reads password=None as "unchanged"
    return sa.make_url(url)._replace(password=None).render_as_string(hide_password=False)


def with_password_of(url: str, known: str) -> str:
    """A described URL, given the password of a known URL (the registry's) that names the same server and user:
    the usual case of a sink in the registry's database. Any other sink's password comes from where its driver
    looks for it (libpq's PGPASSFILE, say), never from a description."""
    described, source = sa.make_url(url), sa.make_url(known)

    def server(u: sa.URL) -> tuple[str, str | None, str | None, int | None, str | None]:
        port = u.port or (5432 if u.get_backend_name() == "postgresql" else None)
        socket = u.query.get("host")  # a Unix socket folder, given in the query string
        return u.get_backend_name(), u.username, u.host, port, str(socket) if socket else None

    same = server(described) == server(source)
    if described.password is not None or source.password is None or not same:
        return url
    return described.set(password=source.password).render_as_string(hide_password=False)


def _insert(connection: Connection) -> Any:
    return (postgresql if connection.dialect.name == "postgresql" else sqlite).insert


@dataclass(frozen=True)
class _Tables:
    target: sa.Table
    staging: sa.Table
    undo: sa.Table
    ledger: sa.Table
    epochs: sa.Table

    @property
    def columns(self) -> list[str]:
        return [c.name for c in self.target.columns]


@functools.lru_cache(maxsize=64)
def _reflect(url: str, table: str, keys: tuple[str, ...]) -> _Tables:
    engine = engine_for(url)
    metadata = sa.MetaData()
    target = sa.Table(table, metadata, autoload_with=engine)
    missing = [k for k in keys if k not in target.columns]
    if missing:
        raise ChangeoverError(f"keyed table {table}", f"it has no column(s) {', '.join(missing)}",
                              f"declare key columns among {', '.join(target.columns.keys())}")
    inspector = sa.inspect(engine)
    unique = [tuple(inspector.get_pk_constraint(table)["constrained_columns"])]
    unique += [tuple(u["column_names"]) for u in inspector.get_unique_constraints(table)]
    unique += [tuple(i["column_names"]) for i in inspector.get_indexes(table) if i.get("unique")]
    if not any(set(u) == set(keys) for u in unique):
        raise ChangeoverError(f"keyed table {table}", f"no primary key or unique index is on ({', '.join(keys)}), "
                              "which upserts need", f"create one: CREATE UNIQUE INDEX ON {table} ({', '.join(keys)})")
    plain = [sa.Column(c.name, c.type) for c in target.columns]
    staging = sa.Table(f"{table}__co_staging", metadata, *plain,
                       sa.Column(OWNER, sa.String(200)), sa.Column(BATCH, sa.BigInteger), sa.Column(RUN, sa.BigInteger),
                       sa.Column(PART, sa.Integer), sa.Column(ATTEMPT, sa.BigInteger),
                       sa.Index(f"ix_{table}__co_staging", OWNER, BATCH, RUN, PART))
    undo = sa.Table(f"{table}__co_undo", metadata, *[sa.Column(c.name, c.type) for c in target.columns],
                    sa.Column(OWNER, sa.String(200)), sa.Column(BATCH, sa.BigInteger), sa.Column(EXISTED, sa.Integer),
                    sa.Index(f"ix_{table}__co_undo", OWNER, BATCH))
    ledger = SinkLedger.__table__
    epochs = sa.Table(EPOCHS, metadata, sa.Column("job", sa.String(100), primary_key=True),
                      sa.Column("epoch", sa.BigInteger, nullable=False))
    for made in (staging, undo, ledger, epochs):
        made.create(engine, checkfirst=True)
    if ATTEMPT not in {c["name"] for c in inspector.get_columns(staging.name)}:  # staged before attempts were tagged
        try:
            with engine.begin() as connection:
                connection.execute(sa.text(f"ALTER TABLE {staging.name} ADD COLUMN {ATTEMPT} BIGINT"))
        except sa.exc.DBAPIError:  # another driver added it first
            if ATTEMPT not in {c["name"] for c in sa.inspect(engine).get_columns(staging.name)}:
                raise
    return _Tables(target, staging, undo, ledger, epochs)  # type: ignore[arg-type]


def _create_target(engine: Engine, table: str, keys: tuple[str, ...], schema: Any) -> None:
    missing = [k for k in keys if k not in schema.fieldNames()]
    if missing:
        raise ChangeoverError(f"keyed table {table}", f"the stage's rows have no column(s) {', '.join(missing)}",
                              f"declare key columns among {', '.join(schema.fieldNames())}")
    columns = [sa.Column(f.name, _sql_type(f), nullable=f.name not in keys) for f in schema.fields]
    created = sa.Table(table, sa.MetaData(), *columns, sa.PrimaryKeyConstraint(*keys))
    created.create(engine, checkfirst=True)


Staged = tuple[int, int]  # (partition, task attempt id) whose rows are the batch's


def _stage_partition(url: str, staging: str, columns: list[str], owner: str, batch_id: int, run_id: int,
                     chunk_rows: int, rows: Iterable[Any]) -> Iterator[Staged]:
    """Runs on an executor (mapPartitions): this partition's rows into the staging table, in chunks, in one
    transaction, tagged with this task attempt; yields (partition, attempt) for the driver's merge."""
    from pyspark import TaskContext

    task = TaskContext.get()
    assert task is not None
    stage_rows(url, staging, columns, owner, batch_id, run_id, chunk_rows, task.partitionId(),
               task.taskAttemptId(), rows)
    # staged, and slow to say so: Spark may speculate a second attempt
    faults.reached_in_job("keyed_table.staged", f"TID {task.taskAttemptId()}")
    yield task.partitionId(), task.taskAttemptId()


def stage_rows(url: str, staging: str, columns: list[str], owner: str, batch_id: int, run_id: int,
               chunk_rows: int, part: int, attempt: int, rows: Iterable[tuple[Any, ...]],
               use_copy: bool | None = None) -> None:
    """One attempt's rows of one partition. Attempts never touch each other's rows: two of them may run at once
    (speculation, a zombie after a false executor loss), and only the one Spark accepted is merged.

    PostgreSQL through psycopg stages with `COPY` (several times the rows per second of batched inserts,
    bench/keyed_table_batch.py); any other database with batched inserts. `use_copy` forces one (the bench)."""
    tags = (owner, batch_id, run_id, part, attempt)
    names = [*columns, OWNER, BATCH, RUN, PART, ATTEMPT]
    # A database away for a moment: wait for it here (a try that failed mid-write is retried by Spark and waits here)
    connection = patiently(engine_for(url).connect, f"stage {owner} batch {batch_id} partition {part}: its sink")
    with connection, connection.begin():
        if use_copy is None:
            use_copy = connection.dialect.name == "postgresql" and connection.dialect.driver == "psycopg"
        if use_copy:
            _copy_rows(connection, staging, names, (tuple(row) + tags for row in rows))
            return
        table = sa.Table(staging, sa.MetaData(), autoload_with=connection)  # typed: SQLite takes no Decimal as it is
        chunk: list[dict[str, Any]] = []
        for row in rows:
            chunk.append(dict(zip(names, tuple(row) + tags, strict=True)))
            if len(chunk) >= chunk_rows:
                connection.execute(sa.insert(table), chunk)
                chunk = []
        if chunk:
            connection.execute(sa.insert(table), chunk)


def _reach_staging(url: str, staging: str, rows: Iterable[Any]) -> Iterator[int]:
    """On an executor: connect to the sink's database and reflect its staging table, staging nothing."""
    with patiently(engine_for(url).connect, f"the staging table {staging}: its sink") as connection:
        sa.Table(staging, sa.MetaData(), autoload_with=connection)
    yield sum(1 for _ in rows)


def _copy_rows(connection: Connection, staging: str, names: list[str], rows: Iterable[tuple[Any, ...]]) -> None:
    """psycopg's COPY FROM STDIN, in the connection's own transaction; psycopg streams the rows in its own
    buffers, so a partition is never held whole."""
    quote = connection.dialect.identifier_preparer.quote
    statement = f"COPY {quote(staging)} ({', '.join(quote(n) for n in names)}) FROM STDIN"
    cursor = connection.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
    with cursor.copy(statement) as copy:
        for row in rows:
            copy.write_row(row)


def _raise_epoch(connection: Connection, epochs: sa.Table, context: WriteContext, batch_id: int, epoch: int) -> None:
    """The sink's own store checks the writer's epoch in the merge's transaction, as Kafka's brokers check producer
    epochs: a writer older than one that already merged here is refused, whatever the registry's records say (a
    sink in another database commits apart from the registry)."""
    connection.execute(_insert(connection)(epochs).values(job=context.job, epoch=epoch)
                       .on_conflict_do_nothing(index_elements=["job"]))
    newest = connection.scalar(sa.select(epochs.c.epoch).where(epochs.c.job == context.job).with_for_update())
    if newest is not None and newest > epoch:
        raise fence.Fenced(f"write of batch {batch_id} of stage {context.stage} of job {context.job} by run "
                           f"{context.run_id} (epoch {epoch})",
                           f"the sink's own database has merged a batch of epoch {newest}, a later owner",
                           "nothing to do: this run was superseded and stops; the current run writes instead")
    if newest != epoch:
        connection.execute(sa.update(epochs).where(epochs.c.job == context.job).values(epoch=epoch))


@dataclass(frozen=True)
class KeyedTable(Sink):
    url: str
    table: str
    keys: tuple[str, ...]
    chunk_rows: int = 10_000
    kind: ClassVar[str] = "keyed_table"
    guarantee: str = "exactly-once"

    def __post_init__(self) -> None:
        check_name("table", self.table)
        if not self.keys:
            raise ChangeoverError(f"keyed table {self.table}", "no key columns are declared",
                                  "pass keys=(...) naming the columns that identify a row")

    def attach(self, frame: Any, context: WriteContext) -> Any:
        return foreach_batch(frame, context, lambda batch, batch_id: self.write(batch, batch_id, context))

    def tables(self, schema: Any = None) -> _Tables:
        with _tables_lock:
            engine = engine_for(self.url)
            if schema is not None and not sa.inspect(engine).has_table(self.table):
                _create_target(engine, self.table, self.keys, schema)
            return _reflect(self.url, self.table, tuple(self.keys))

    def write(self, batch: Any, batch_id: int, context: WriteContext) -> bool:
        """Write one micro-batch; False when the ledger shows it was written before.

        A database that does not answer (restarting, failing over) is waited for, step by step: each database step
        is safe to repeat, the partitions wait for it themselves, and the batch's data is staged once per try, as
        Spark's batch runs once. A merge whose commit's answer was lost is found in the ledger on its retry."""
        waiting = f"job {context.job} stage {context.stage} batch {batch_id}: its sink or the registry"
        tables = context.patiently(functools.partial(self.tables, batch.schema), waiting)
        owner = f"{context.job}/{context.stage}"
        written = functools.partial(self._written, engine_for(self.url), tables, context, batch_id)
        if context.patiently(written, waiting):
            run_without_writing(batch)  # a replay: the rows are written
            return False
        context.patiently(functools.partial(self._unstage, tables, owner, batch_id, context.run_id), waiting)
        stage = functools.partial(_stage_partition, self.url, tables.staging.name, batch.columns, owner, batch_id,
                                  context.run_id, self.chunk_rows)
        staged = batch.rdd.mapPartitions(stage).collect()  # one accepted attempt per partition, as Spark decided
        merge = functools.partial(self._merge_fenced, tables, context, owner, batch_id, staged)
        return context.patiently(merge, waiting)

    def _unstage(self, tables: _Tables, owner: str, batch_id: int, run_id: int) -> None:
        """What an interrupted try of this run staged; only this run's: another run's try of the same batch id may
        be staging now (the fence decides which one merges)."""
        staged = tables.staging.c
        with engine_for(self.url).begin() as connection:
            connection.execute(sa.delete(tables.staging).where(staged[OWNER] == owner, staged[BATCH] == batch_id,
                                                               staged[RUN] == run_id))

    def _merge_fenced(self, tables: _Tables, context: WriteContext, owner: str, batch_id: int,
                      staged: list[Staged]) -> bool:
        with context.hold(batch_id) as held:
            if self.url == context.registry_url:
                return self._merge(held.session.connection(), tables, context, owner, batch_id, staged, held.epoch)
            with engine_for(self.url).begin() as connection:
                merged = self._merge(connection, tables, context, owner, batch_id, staged, held.epoch)
            faults.reached_in_job("keyed_table.committed")  # in the sink's database, not yet in the registry
            return merged

    def _written(self, engine: Engine, tables: _Tables, context: WriteContext, batch_id: int) -> bool:
        ledger = tables.ledger.c
        with engine.connect() as connection:
            return connection.scalar(sa.select(ledger.batch_id).where(
                ledger.job == context.job, ledger.stage == context.stage, ledger.batch_id == batch_id)) is not None

    def _merge(self, connection: Connection, tables: _Tables, context: WriteContext, owner: str,
               batch_id: int, staged: list[Staged], epoch: int) -> bool:
        _raise_epoch(connection, tables.epochs, context, batch_id, epoch)
        staging, target, undo, ledger = tables.staging.c, tables.target, tables.undo, tables.ledger
        mine = ((staging[OWNER] == owner) & (staging[BATCH] == batch_id) & (staging[RUN] == context.run_id)
                & sa.tuple_(staging[PART], staging[ATTEMPT]).in_([tuple(s) for s in staged]))
        # inside the fence, every run's rows of this batch and the ones before are done with (a zombie attempt may
        # have staged after its batch merged): only the current run merges, once
        clear = sa.delete(tables.staging).where(staging[OWNER] == owner, staging[BATCH] <= batch_id)
        if connection.scalar(sa.select(ledger.c.batch_id).where(
                ledger.c.job == context.job, ledger.c.stage == context.stage,
                ledger.c.batch_id == batch_id)) is not None:
            connection.execute(clear)
            return False
        keys, columns = list(self.keys), tables.columns
        doubled = connection.scalar(sa.select(sa.func.count()).select_from(
            sa.select(*[staging[k] for k in keys]).where(mine).group_by(*[staging[k] for k in keys])
            .having(sa.func.count() > 1).subquery()))
        if doubled:
            raise ChangeoverError(f"batch {batch_id} of stage {context.stage} into table {self.table}",
                                  f"{doubled} key(s) of ({', '.join(keys)}) occur more than once in the batch",
                                  "declare keys that identify one row per batch, or aggregate before the sink")
        same_key = sa.and_(*[target.c[k] == staging[k] for k in keys])
        connection.execute(sa.insert(undo).from_select([*columns, OWNER, BATCH, EXISTED], sa.select(
            *[target.c[c] for c in columns], sa.literal(owner), sa.literal(batch_id), sa.literal(1)
        ).where(sa.exists().where(same_key, mine))))
        connection.execute(sa.insert(undo).from_select([*keys, OWNER, BATCH, EXISTED], sa.select(
            *[staging[k] for k in keys], sa.literal(owner), sa.literal(batch_id), sa.literal(0)
        ).where(mine, ~sa.exists().where(same_key))))
        rows = int(connection.scalar(sa.select(sa.func.count()).where(mine)) or 0)
        upsert = _insert(connection)(target).from_select(columns, sa.select(*[staging[c] for c in columns]).where(mine))
        values = [c for c in columns if c not in keys]
        upsert = (upsert.on_conflict_do_update(index_elements=keys, set_={c: upsert.excluded[c] for c in values})
                  if values else upsert.on_conflict_do_nothing(index_elements=keys))
        connection.execute(upsert)
        connection.execute(sa.insert(ledger).values(job=context.job, stage=context.stage, batch_id=batch_id,
                                                    rows=rows, run_id=context.run_id, written_at=sa.func.now()))
        connection.execute(clear)
        return True

    def describe(self) -> dict[str, Any]:
        # Kept in the registry and in savepoint manifests, so without its password (see `with_password_of`).
        return {"kind": self.kind, "guarantee": self.guarantee, "url": without_password(self.url),
                "table": self.table, "keys": list(self.keys)}

    @classmethod
    def from_description(cls, description: dict[str, Any]) -> KeyedTable:
        return cls(description["url"], description["table"], tuple(description["keys"]))

    def progress(self, context: WriteContext) -> int | None:
        if not sa.inspect(engine_for(self.url)).has_table(SinkLedger.__tablename__):
            return None
        ledger = SinkLedger.__table__.c
        with engine_for(self.url).connect() as connection:
            return connection.scalar(sa.select(sa.func.max(ledger.batch_id)).where(
                ledger.job == context.job, ledger.stage == context.stage))

    def written_by(self, context: WriteContext) -> bool | None:
        if self.url == context.registry_url:
            return None  # in the registry's database, the fence's record commits with the merge
        if not sa.inspect(engine_for(self.url)).has_table(SinkLedger.__tablename__):
            return False
        ledger = SinkLedger.__table__.c
        with engine_for(self.url).connect() as connection:
            return connection.scalar(sa.select(ledger.batch_id).where(
                ledger.job == context.job, ledger.stage == context.stage, ledger.run_id == context.run_id
            ).limit(1)) is not None

    def rewind(self, context: WriteContext, batch: int | None, saved: Path | None) -> str:
        tables = self.tables()
        target, undo, keys = tables.target, tables.undo, list(self.keys)
        owner, floor = f"{context.job}/{context.stage}", -1 if batch is None else batch
        with engine_for(self.url).begin() as connection:
            later = list(connection.scalars(sa.select(undo.c[BATCH]).where(
                undo.c[OWNER] == owner, undo.c[BATCH] > floor).distinct().order_by(undo.c[BATCH].desc())))
            for undone in later:  # newest first: each batch's undo holds the rows as they were before it
                of_batch = (undo.c[OWNER] == owner) & (undo.c[BATCH] == undone)
                same_key = sa.and_(*[undo.c[k] == target.c[k] for k in keys])
                connection.execute(sa.delete(target).where(sa.exists().where(same_key, of_batch)))
                connection.execute(sa.insert(target).from_select(tables.columns, sa.select(
                    *[undo.c[c] for c in tables.columns]).where(of_batch, undo.c[EXISTED] == 1)))
                connection.execute(sa.delete(undo).where(of_batch))
            ledger = tables.ledger.c
            connection.execute(sa.delete(tables.ledger).where(
                ledger.job == context.job, ledger.stage == context.stage, ledger.batch_id > floor))
            connection.execute(sa.delete(tables.staging).where(tables.staging.c[OWNER] == owner))
        return f"undid {len(later)} batch(es) of {self.table} after batch {batch}"

    def shadow(self, batch: Any, scratch: Path) -> None:
        """Reads only: the driver reflects the tables and every partition's task connects and reflects the staging
        table, as a write's first steps do, so the follower's first real batch finds them warm; no row is staged."""
        staging = self.tables(batch.schema).staging.name
        # the batch's one run, as a real write's staging is: its state stores commit in these tasks
        batch.rdd.mapPartitions(functools.partial(_reach_staging, self.url, staging)).collect()

    def redirected(self, suffix: str) -> KeyedTable:
        return replace(self, table=f"{self.table}__{suffix}")

    def read(self) -> list[dict[str, Any]]:
        """Every row of the table, e.g. to check results; none before the table's first batch."""
        if not sa.inspect(engine_for(self.url)).has_table(self.table):
            return []
        with engine_for(self.url).connect() as connection:
            table = sa.Table(self.table, sa.MetaData(), autoload_with=connection)
            return [dict(row._mapping) for row in connection.execute(sa.select(table))]

