"""Light jobs through Spark Connect (seeds 000 and 004): routing to the largest version group, seed 000's version
check between routing and execution, and a drain that interrupts a light job past its shutdown timeout."""

from __future__ import annotations

import contextvars
import json
import random
import threading
from types import SimpleNamespace
from typing import Any

import pytest
from changeover import light
from changeover.cluster import LocalCluster, wait_for
from changeover.light import client as light_session
from changeover.light import ledger
from changeover.registry.db import session_scope
from changeover.registry.models import Event
from changeover.settings import Settings
from changeover.upgrade import drain, member_upgrade
from sqlalchemy import select

SERVERS = {"a": ("4.2.0", "sc://a:1"), "b": ("4.2.0", "sc://b:1"), "c": ("4.3.0", "sc://c:1")}


def test_a_light_job_goes_to_a_random_member_of_the_largest_group() -> None:
    chosen = {light.choose(SERVERS, random.Random(seed)).member for seed in range(20)}
    assert chosen == {"a", "b"}  # both members of the larger 4.2.0 group, never the 4.3.0 one


def test_on_a_tie_the_higher_version_wins() -> None:
    tie = {**SERVERS, "d": ("4.3.0", "sc://d:1")}
    assert {light.choose(tie, random.Random(seed)).version for seed in range(10)} == {"4.3.0"}
    assert light.choose({"z": ("4.2.1", "sc://z:1"), "y": ("4.2.0", "sc://y:1")}).member == "z"


def test_no_server_is_refused_with_what_to_do() -> None:
    with pytest.raises(light.NoLightServer, match="--light-jobs"):
        light.choose({})


@pytest.mark.slow
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_member_upgraded_between_routing_and_execution_refuses_and_the_job_is_rerouted(
    settings: Settings, cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster.up([("m1", "4.2.0"), ("m2", "4.2.0")], light_jobs=True)
    rows, where = light.run_sql(settings, "SELECT 40 + 2 AS answer, split(version(), ' ')[0] AS version")
    assert rows == [{"answer": 42, "version": "4.2.0"}] and where.version == "4.2.0"

    # A light job that does not block shutdown, running on m1 when m1's drain begins: interrupted past its timeout.
    outcome: dict[str, Any] = {}
    started = threading.Event()

    def long_job() -> None:
        try:
            with light.session(settings, statement="count a long range", block_shutdown=False,
                               shutdown_timeout=2) as job:
                outcome["tag"] = job.tag
                started.set()
                job.spark.range(0, 10**13).selectExpr("sum(id)").collect()
        except Exception as exc:  # noqa: BLE001 - what the interrupt raised is what is checked
            outcome["error"] = str(exc)
        finally:
            started.set()

    monkeypatch.setattr(light_session, "route", lambda s, exclude=frozenset(): light.routing.route(
        s, exclude=frozenset({"m2", *exclude})))
    runner = threading.Thread(target=long_job)
    runner.start()
    assert started.wait(120) and "tag" in outcome, outcome
    monkeypatch.undo()
    stale = light.Route("m1", "4.2.0", ledger.get(settings, outcome["tag"]).server)  # routed before the upgrade

    wait_for(lambda: drain.step(settings, cluster, "m1", shutdown_timeout=2).done, 180, "m1's drain", interval=1)
    runner.join(60)
    assert "OPERATION_CANCELED" in outcome.get("error", ""), outcome
    assert ledger.get(settings, outcome["tag"]).state == "INTERRUPTED"
    assert not cluster.connect_running("m1")  # stopped once no light job was left on it
    member_upgrade.upgrade_member(settings, cluster, "m1", "4.3.0")
    assert cluster.connect_running("m1")  # back at the new version

    # Seed 000's check: the job routed to the 4.2.0 group before m1's upgrade reaches m1's server, now at 4.3.0.
    with pytest.raises(light.VersionChanged, match="routed to the Spark 4.2.0 group, and its server runs Spark 4.3.0"):
        light_session.open_checked(stale, "alice")
    calls: list[light.Route] = []

    def routed_before_the_upgrade_first(s: Settings, exclude: frozenset[str] = frozenset()) -> light.Route:
        calls.append(stale if not calls else light.routing.route(s, exclude=exclude))
        return calls[-1]

    monkeypatch.setattr(light_session, "route", routed_before_the_upgrade_first)
    with light.session(settings, statement="SELECT version()") as job:
        found = job.spark.sql("SELECT split(version(), ' ')[0] AS v").collect()[0]["v"]
    assert len(calls) == 2 and len(job.refusals) == 1 and "Spark 4.3.0" in job.refusals[0]
    assert job.route.member == "m2" and found == job.route.version == "4.2.0"  # never a mixed answer
    with session_scope(settings.database_url) as s:
        rerouted = s.scalars(select(Event).where(Event.action == "light.reroute")).all()
    assert [(e.subject, e.outcome) for e in rerouted] == [("m1", "refused")]

    # The Airflow operator, its context a stand-in: the Spark provider's connection gives the client's identity,
    # and a killed task interrupts its own operations on the server.
    from changeover_airflow.operators import LightJobOperator

    monkeypatch.setenv("AIRFLOW_CONN_CHANGEOVER_DEFAULT", json.dumps(
        {"conn_type": "generic", "extra": {"home": str(settings.home), "database_url": settings.database_url}}))
    monkeypatch.setenv("AIRFLOW_CONN_SPARK_CONNECT_DEFAULT", json.dumps(
        {"conn_type": "spark_connect", "host": "ignored-routing-decides", "login": "analyst"}))
    ti = SimpleNamespace(dag_id="light_sql", run_id="r1", task_id="sql", try_number=1)
    context = {"ti": ti, "params": {}, "dag_run": SimpleNamespace(triggering_user_name="alice")}
    quick = LightJobOperator(task_id="sql", sql="SELECT 6 * 7 AS answer", spark_connect_conn_id="spark_connect_default")
    assert contextvars.copy_context().run(quick.execute, context) == [{"answer": 42}]
    long = LightJobOperator(task_id="sql", sql="SELECT sum(id) FROM range(0, 10000000000000)",
                            spark_connect_conn_id="spark_connect_default")
    failure: dict[str, str] = {}

    def run_task() -> None:
        try:
            contextvars.copy_context().run(long.execute, context)
        except Exception as exc:  # noqa: BLE001 - the interrupt's error is what is checked
            failure["error"] = str(exc)

    task = threading.Thread(target=run_task)
    task.start()
    wait_for(lambda: long._running is not None, 60, "the task's light job starting")
    tag = long._running[1]
    long.on_kill()
    task.join(60)
    assert "OPERATION_CANCELED" in failure.get("error", ""), failure
    killed = ledger.get(settings, tag)
    assert killed.state == "INTERRUPTED" and killed.user_id == "analyst" and "was killed" in killed.error
    with session_scope(settings.database_url) as s:
        started = s.scalar(select(Event).where(Event.action == "light.start", Event.subject == tag))
    assert started.actor.startswith("alice via airflow:light_sql/r1/sql#1")


def test_closing_the_pool_stops_every_pooled_session_and_empties_it() -> None:
    """A process done with light jobs closes what it pooled, as an engine's dispose does. The sessions are stand-ins
    with a `stop` (no Connect server here): the pool's own bookkeeping is the subject."""
    stopped: list[str] = []
    sessions = {key: SimpleNamespace(stop=lambda key=key: stopped.append(key)) for key in ("m1", "m2")}
    with light_session._pool_lock:
        light_session._pool.update({(f"sc://{key}:15002", "alice", ""): spark for key, spark in sessions.items()})
    assert light.close_pool() == 2
    assert sorted(stopped) == ["m1", "m2"] and not light_session._pool
    assert light.close_pool() == 0
