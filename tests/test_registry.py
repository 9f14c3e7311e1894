from changeover import audit
from changeover.registry.db import engine_for, session_scope
from changeover.registry.models import Event
from changeover.registry.schema import migrate
from changeover.settings import Settings
from sqlalchemy import inspect, select


def test_migrations_create_every_table_and_are_idempotent(settings: Settings) -> None:
    migrate(settings.database_url)  # a second run changes nothing
    tables = set(inspect(engine_for(settings.database_url)).get_table_names())
    expected = {"members", "masters", "jobs", "job_runs", "savepoints", "upgrade_runs", "events", "sink_ledger"}
    assert expected <= tables


def test_events_record_who_what_when_and_outcome(settings: Settings, monkeypatch) -> None:
    monkeypatch.setenv("CHANGEOVER_ACTOR", "tester")
    with session_scope(settings.database_url) as s:
        audit.record(s, "member.add", "member", "m1", version="4.2.0")
    with session_scope(settings.database_url) as s:
        event = s.scalars(select(Event)).one()
    assert (event.actor, event.action, event.subject, event.outcome) == ("tester", "member.add", "m1", "ok")
    assert event.details == {"version": "4.2.0"} and event.at is not None
