"""SQLAlchemy 2 typed ORM models of the registry."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, DateTime, ForeignKey, Integer, String, Text, UniqueConstraint, false
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from changeover.registry.states import PARKED_FORMS, Desired


def utcnow() -> datetime:
    return datetime.now(UTC)


# Job.desired besides RUN: STOP (a user's stop with a savepoint: the driver exits at the boundary) and MOVE
# (a drain's or rebalance's stop: the driver parks at the boundary, holding a lease until its successor writes).
STOPPING = (Desired.STOP, Desired.MOVE)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, datetime: DateTime(timezone=True)}


class Master(Base):
    """One Spark master per version group."""

    __tablename__ = "masters"
    version: Mapped[str] = mapped_column(String(32), primary_key=True)
    host: Mapped[str] = mapped_column(String(64))
    port: Mapped[int]
    webui_port: Mapped[int]
    rest_port: Mapped[int]
    pid: Mapped[int | None]
    pid_started: Mapped[str | None] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16))  # RUNNING | STOPPED

    @property
    def url(self) -> str:
        return f"spark://{self.host}:{self.port}"


class Member(Base):
    """A cluster member: one Spark standalone worker at one Spark version."""

    __tablename__ = "members"
    name: Mapped[str] = mapped_column(String(100), primary_key=True)
    version: Mapped[str] = mapped_column(String(32))
    host: Mapped[str] = mapped_column(String(64))
    webui_port: Mapped[int | None]
    pid: Mapped[int | None]
    pid_started: Mapped[str | None] = mapped_column(String(32))
    # a `states.MemberStatus`
    status: Mapped[str] = mapped_column(String(16))
    drain_started_at: Mapped[datetime | None]
    maintenance: Mapped[str | None] = mapped_column(String(250))  # why it is marked for the next drain window
    # whether it runs a Spark Connect server at its version, the coordinator of the light jobs routed to it
    light_jobs: Mapped[bool] = mapped_column(default=False, server_default=false())
    connect_port: Mapped[int | None]
    connect_pid: Mapped[int | None]
    connect_pid_started: Mapped[str | None] = mapped_column(String(32))
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class Job(Base):
    __tablename__ = "jobs"
    name: Mapped[str] = mapped_column(String(100), primary_key=True)
    module: Mapped[str] = mapped_column(String(200))  # the name the driver imports
    code: Mapped[str | None] = mapped_column(Text)  # the artifact shipped with --py-files
    entry: Mapped[str] = mapped_column(String(16), default="build", server_default="build")  # build | run | script
    fault_tolerant: Mapped[bool]
    block_shutdown: Mapped[bool]
    shutdown_timeout: Mapped[int] = mapped_column(Integer, default=30)
    options: Mapped[dict[str, Any]] = mapped_column(default=dict)
    # RUN, or one of STOPPING
    desired: Mapped[str] = mapped_column(String(16), default="RUN")
    current_run_id: Mapped[int | None]
    # The fencing epoch: raised at every change of ownership (a launch, a hand-over, a parked run's reclaim), so a
    # later owner always writes with a larger one than any run before it, whatever their run ids.
    epoch: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    def make_current(self, run: JobRun) -> bool:
        """`run` owns the job from now on, under a new epoch, and the job's code is the code it runs (a zero-downtime
        update's follower runs new code before it owns the job; a parked run that takes it back, the old). True
        when that changed the job's code. The caller holds the job row's lock."""
        self.epoch = (self.epoch or 0) + 1
        self.current_run_id, run.epoch = run.id, self.epoch
        if run.code is None or run.code.get("code") == self.code:
            return False
        self.module, self.code, self.entry = run.code["module"], run.code["code"], run.code["entry"]
        return True

    def code_of(self) -> dict[str, str]:
        """The job's code as a run records it."""
        return {"code": self.code or "", "module": self.module, "entry": self.entry}


class JobRun(Base):
    """One launch of a job: a Spark driver at one version, with its own checkpoint root."""

    __tablename__ = "job_runs"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    job: Mapped[str] = mapped_column(ForeignKey("jobs.name"), index=True)
    spark_version: Mapped[str] = mapped_column(String(32))
    master_url: Mapped[str] = mapped_column(String(200))
    submission_id: Mapped[str | None] = mapped_column(String(100))
    member: Mapped[str | None] = mapped_column(String(100))
    checkpoint_root: Mapped[str | None] = mapped_column(Text)
    from_savepoint: Mapped[str | None] = mapped_column(String(100))
    # a `states.RunState`: PARKED is a run stopped at a batch boundary whose driver lives, holding its lease until
    # a successor writes; STANDBY a warm successor (see `changeover.upgrade.warm`) waiting for `standby_of` to park.
    state: Mapped[str] = mapped_column(String(16))
    error: Mapped[str | None] = mapped_column(Text)
    progress: Mapped[dict[str, Any]] = mapped_column(default=dict)  # stage -> last committed batch
    # stage -> rows of Spark's `state-metadata` reader, as the driver read them
    operators: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    sinks: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # stage -> its sink's description
    plans: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # stage -> its stateful plan (changeover.compat)
    submitted_at: Mapped[datetime] = mapped_column(default=utcnow)
    heartbeat_at: Mapped[datetime | None]
    first_commit_at: Mapped[datetime | None]
    # when every query had finished its first trigger: a batch committed, or found no new input
    first_trigger_at: Mapped[datetime | None]
    last_commit_at: Mapped[datetime | None]
    ended_at: Mapped[datetime | None]
    lease_until: Mapped[datetime | None]  # a parked run resumes by itself after this
    parks: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # times it stopped at a boundary
    # when it took the job over (its first sink write or its first cycle): from then on it cannot be fenced off
    first_write_at: Mapped[datetime | None]
    epoch: Mapped[int | None] = mapped_column(BigInteger)  # the job's epoch when this run last became its owner
    standby_of: Mapped[int | None] = mapped_column(index=True)  # the run a warm standby is to succeed
    ready_at: Mapped[datetime | None]  # when a standby had its session, executors and plans, ready for a checkpoint
    # a zero-downtime standby given a checkpoint of its own, replaying its predecessor's batches read-only since
    following_since: Mapped[datetime | None]
    # the count of state partitions its driver repartitions restored stages to before they start (None: as saved)
    state_partitions: Mapped[int | None]
    code: Mapped[dict[str, str] | None] = mapped_column(JSON)  # what it was launched with (`Job.code_of`)
    # a run stopping for a move: the batch it stops after, per stage, said once that batch has begun (a follower
    # starts its queries as that batch commits, `runtime.standby`); cleared when the stop is withdrawn or it resumes
    stopping_after: Mapped[dict[str, int] | None] = mapped_column(JSON)

    @property
    def parked(self) -> bool:
        # STOPPED with no end: how a driver launched before PARKED was a state (migration 0013) records its park
        return self.state in PARKED_FORMS and self.ended_at is None


class Savepoint(Base):
    __tablename__ = "savepoints"
    __table_args__ = (UniqueConstraint("job", "name"),)
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    job: Mapped[str] = mapped_column(ForeignKey("jobs.name"), index=True)
    name: Mapped[str] = mapped_column(String(100))
    mode: Mapped[str] = mapped_column(String(16))  # stop | continue
    status: Mapped[str] = mapped_column(String(16))  # PENDING while being built, then COMPLETED
    path: Mapped[str] = mapped_column(Text)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    spark_version: Mapped[str] = mapped_column(String(32))
    stages: Mapped[dict[str, Any]] = mapped_column(default=dict)  # stage -> last committed batch
    run_id: Mapped[int | None]
    upgrade_key: Mapped[str | None] = mapped_column(String(250))  # the upgrade that took it, if any
    owner: Mapped[str | None] = mapped_column(String(100))  # "host:pid:start" of the process building it
    lease_until: Mapped[datetime | None]  # while PENDING: its builder renews this; past it, any host may clear it
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class UpgradeRun(Base):
    __tablename__ = "upgrade_runs"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    key: Mapped[str] = mapped_column(String(250), unique=True)  # e.g. the Airflow run id
    target_version: Mapped[str] = mapped_column(String(32))
    members: Mapped[dict[str, Any]] = mapped_column(default=dict)  # member -> old version
    status: Mapped[str] = mapped_column(String(16))  # RUNNING | SUCCEEDED | FAILED | ABORTED
    progress: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # member -> its `states.UpgradePhase`
    actor: Mapped[str | None] = mapped_column(String(250))  # who triggered it
    # 1 while RUNNING, else NULL: the unique constraint is the registry lock, one running upgrade at a time
    active: Mapped[int | None] = mapped_column(Integer, unique=True)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]


class Event(Base):
    """Append-only audit trail: who did what to which subject, when, and the outcome."""

    __tablename__ = "events"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    actor: Mapped[str] = mapped_column(String(250))
    action: Mapped[str] = mapped_column(String(64), index=True)
    subject_kind: Mapped[str] = mapped_column(String(32))
    subject: Mapped[str] = mapped_column(String(200), index=True)
    outcome: Mapped[str] = mapped_column(String(32))
    details: Mapped[dict[str, Any]] = mapped_column(default=dict)
    upgrade: Mapped[str | None] = mapped_column(String(250), index=True)  # the upgrade it was part of


class SinkLedger(Base):
    """Batches a sink has written, per job and stage: a keyed table keeps it in its own database, beside its rows."""

    __tablename__ = "sink_ledger"
    job: Mapped[str] = mapped_column(String(100), primary_key=True)
    stage: Mapped[str] = mapped_column(String(100), primary_key=True)
    batch_id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    rows: Mapped[int]
    run_id: Mapped[int | None] = mapped_column(BigInteger)  # the epoch that wrote it
    written_at: Mapped[datetime] = mapped_column(default=utcnow)


class LightJob(Base):
    """A light job: SQL or a DataFrame run through a member's Spark Connect server, not fault-tolerant.
    Its row lets a drain wait for it (block_shutdown) or interrupt it by its tag, and the leak checker find it."""

    __tablename__ = "light_jobs"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    tag: Mapped[str] = mapped_column(String(100), unique=True)  # the Connect operation tag it runs under
    member: Mapped[str] = mapped_column(String(100), index=True)
    spark_version: Mapped[str] = mapped_column(String(32))  # its server's, checked when the session opened
    server: Mapped[str] = mapped_column(String(200))  # sc://host:port
    session_id: Mapped[str] = mapped_column(String(64))  # so another client can interrupt it by tag
    user_id: Mapped[str] = mapped_column(String(100))
    statement: Mapped[str | None] = mapped_column(Text)  # what it runs, shortened, for the audit
    block_shutdown: Mapped[bool]
    shutdown_timeout: Mapped[int]
    state: Mapped[str] = mapped_column(String(16), index=True)  # a `states.LightState`
    actor: Mapped[str | None] = mapped_column(String(250))
    error: Mapped[str | None] = mapped_column(Text)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    ended_at: Mapped[datetime | None]
    # the Connect server process it ran on: a server restarted since (another process) took the job's session
    server_pid: Mapped[int | None]
    server_pid_started: Mapped[str | None] = mapped_column(String(32))
    heartbeat_at: Mapped[datetime | None]  # its client's, every few seconds while the job runs
