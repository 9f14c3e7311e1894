"""SQLite hands back naive datetimes; every timestamp Changeover stores is UTC."""

from datetime import UTC, datetime


def as_utc(value: datetime) -> datetime:
    return value if value.tzinfo else value.replace(tzinfo=UTC)
