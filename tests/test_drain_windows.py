"""Drain windows and their Airflow timetable, on fixed clocks (2026-11-22 is a Sunday)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, time, timedelta, timezone

import pendulum
import pytest
from airflow.timetables.base import DagRunInfo, DataInterval, TimeRestriction
from changeover.errors import ChangeoverError
from changeover.upgrade.windows import DrainWindow, may_start_drain
from changeover_airflow import timetables
from changeover_airflow.plugin import ChangeoverPlugin
from changeover_airflow.timetables import DrainWindowTimetable


def at(day: int, hour: int, minute: int = 0, second: int = 0, month: int = 11) -> datetime:
    return datetime(2026, month, day, hour, minute, second, tzinfo=UTC)


def pat(day: int, hour: int, minute: int = 0, month: int = 11) -> pendulum.DateTime:
    """The same, as the pendulum DateTime the Airflow scheduler passes in."""
    return pendulum.instance(at(day, hour, minute, month=month))


SUNDAY = DrainWindow.parse("SUN 02:00-04:00")
WEEKEND = DrainWindow.parse("SAT,SUN 01:00-03:30")
MIDNIGHT = DrainWindow.parse("SUN 23:00-01:00")


# --- parsing ---------------------------------------------------------------------------------------------------


def test_parse_reads_days_and_times() -> None:
    assert DrainWindow(days=(6,), start=time(2, 0), end=time(4, 0)) == SUNDAY
    assert DrainWindow(days=(5, 6), start=time(1, 0), end=time(3, 30)) == WEEKEND
    assert SUNDAY.duration == timedelta(hours=2)
    assert WEEKEND.duration == timedelta(hours=2, minutes=30)


def test_parse_accepts_lowercase_unordered_days_and_a_utc_suffix_and_prints_canonically() -> None:
    window = DrainWindow.parse("  sun,sat 1:00-03:30 utc ")
    assert window == WEEKEND
    assert window.spec == str(window) == "SAT,SUN 01:00-03:30"
    assert DrainWindow.parse(window.spec) == window


def test_window_crossing_midnight_ends_the_next_day() -> None:
    assert MIDNIGHT.duration == timedelta(hours=2)
    assert DrainWindow.parse("SUN 22:00-00:00").duration == timedelta(hours=2)


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ("FOO 02:00-04:00", "unknown day 'FOO' (days are MON, TUE, WED, THU, FRI, SAT, SUN)"),
        ("MON-FRI 02:00-04:00", "day ranges like 'MON-FRI' are not supported"),
        ("SUN,SUN 02:00-04:00", "day SUN is listed twice"),
        ("SUN", "it is not of the form DAYS HH:MM-HH:MM"),
        ("", "it is not of the form DAYS HH:MM-HH:MM"),
        ("SUN 02:00 04:00 UTC", "it is not of the form DAYS HH:MM-HH:MM"),
        ("SUN 2-4", "'2-4' is not a time range HH:MM-HH:MM"),
        ("SUN 02:00-24:00", "24:00 is not a time of day (00:00..23:59)"),
        ("SUN 02:60-04:00", "02:60 is not a time of day (00:00..23:59)"),
        ("SUN 02:00-02:00", "it closes at the moment it opens"),
        ("SUN 02:00-04:00 CET", "time zone 'CET' is not supported; drain windows are in UTC"),
    ],
)
def test_parse_refuses_bad_specs_saying_what_why_and_what_to_do(spec: str, reason: str) -> None:
    with pytest.raises(ChangeoverError) as refused:
        DrainWindow.parse(spec)
    assert refused.value.refused == f"drain window {spec!r}"
    assert refused.value.reason == reason
    assert refused.value.fix  # every refusal says what to do instead


def test_unknown_day_message_shows_how_to_write_it() -> None:
    with pytest.raises(ChangeoverError, match=r"^drain window 'FOO 02:00-04:00': unknown day 'FOO' .*"
                                              r"write it like 'SUN 02:00-04:00'$"):
        DrainWindow.parse("FOO 02:00-04:00")


@pytest.mark.parametrize(
    ("days", "start", "end"),
    [((), time(2), time(4)), ((6, 5), time(2), time(4)), ((7,), time(2), time(4)), ((6,), time(2), time(2)),
     ((6,), time(2, 0, 30), time(4)), ((6,), time(2, tzinfo=UTC), time(4))],
)
def test_direct_construction_is_validated_too(days: tuple[int, ...], start: time, end: time) -> None:
    with pytest.raises(ChangeoverError):
        DrainWindow(days=days, start=start, end=end)


def test_window_is_frozen() -> None:
    with pytest.raises(AttributeError):
        SUNDAY.start = time(3)  # type: ignore[misc]


# --- occurrences -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("now", "expected"),
    [
        (at(22, 2), (at(22, 2), at(22, 4))),  # opens inclusive
        (at(22, 3, 59, 59), (at(22, 2), at(22, 4))),
        (at(22, 1, 59, 59), None),
        (at(22, 4), None),  # closes exclusive
        (at(21, 3), None),  # right time, wrong day
        (at(29, 3), (at(29, 2), at(29, 4))),  # a week later
    ],
)
def test_opening_at_inside_and_outside(now: datetime, expected: tuple[datetime, datetime] | None) -> None:
    assert SUNDAY.opening_at(now) == expected


def test_opening_at_with_several_days() -> None:
    assert WEEKEND.opening_at(at(21, 1, 30)) == (at(21, 1), at(21, 3, 30))
    assert WEEKEND.opening_at(at(22, 3, 29)) == (at(22, 1), at(22, 3, 30))
    assert WEEKEND.opening_at(at(23, 1, 30)) is None


def test_window_crossing_midnight_is_open_on_both_sides_of_it() -> None:
    occurrence = (at(22, 23), at(23, 1))
    assert MIDNIGHT.opening_at(at(22, 23, 30)) == occurrence
    assert MIDNIGHT.opening_at(at(23, 0, 30)) == occurrence  # Monday morning belongs to Sunday's window
    assert MIDNIGHT.opening_at(at(23, 1)) is None
    assert MIDNIGHT.opening_at(at(22, 0, 30)) is None  # Sunday morning: Saturday has no window
    assert MIDNIGHT.next_opening(at(23, 0, 30)) == (at(29, 23), at(30, 1))
    assert MIDNIGHT.previous_opening(at(23, 0, 30)) == occurrence


def test_next_opening_is_inclusive_unless_strict() -> None:
    assert SUNDAY.next_opening(at(21, 10)) == (at(22, 2), at(22, 4))
    assert SUNDAY.next_opening(at(22, 2)) == (at(22, 2), at(22, 4))
    assert SUNDAY.next_opening(at(22, 2), strict=True) == (at(29, 2), at(29, 4))
    assert SUNDAY.next_opening(at(22, 3)) == (at(29, 2), at(29, 4))  # inside: the next one, not this one
    assert WEEKEND.next_opening(at(21, 5)) == (at(22, 1), at(22, 3, 30))


def test_previous_opening_is_the_latest_at_or_before() -> None:
    assert SUNDAY.previous_opening(at(22, 2)) == (at(22, 2), at(22, 4))
    assert SUNDAY.previous_opening(at(22, 1, 59)) == (at(15, 2), at(15, 4))
    assert SUNDAY.previous_opening(at(25, 12)) == (at(22, 2), at(22, 4))  # already closed, still the latest
    assert WEEKEND.previous_opening(at(22, 0, 30)) == (at(21, 1), at(21, 3, 30))


def test_seconds_left() -> None:
    assert SUNDAY.seconds_left(at(22, 2)) == 7200.0
    assert SUNDAY.seconds_left(at(22, 3, 58)) == 120.0
    assert SUNDAY.seconds_left(at(22, 4)) == 0.0
    assert SUNDAY.seconds_left(at(21, 3)) == 0.0
    assert MIDNIGHT.seconds_left(at(23, 0, 30)) == 1800.0


def test_aware_times_in_other_zones_are_read_as_the_same_instant() -> None:
    berlin_winter = timezone(timedelta(hours=1))
    # 04:30 at UTC+1 is 03:30 UTC: inside; 02:30 at UTC+1 is 01:30 UTC: not yet open.
    occurrence = SUNDAY.opening_at(datetime(2026, 11, 22, 4, 30, tzinfo=berlin_winter))
    assert occurrence == (at(22, 2), at(22, 4))
    assert occurrence[0].utcoffset() == timedelta(0)  # answers come back in UTC
    assert SUNDAY.opening_at(datetime(2026, 11, 22, 2, 30, tzinfo=berlin_winter)) is None
    assert SUNDAY.seconds_left(datetime(2026, 11, 22, 4, 30, tzinfo=berlin_winter)) == 1800.0
    # Saturday 23:30 at UTC-3 is already Sunday 02:30 UTC: the UTC date decides the day.
    saturday_night_in_brazil = datetime(2026, 11, 21, 23, 30, tzinfo=timezone(timedelta(hours=-3)))
    assert SUNDAY.opening_at(saturday_night_in_brazil) == (at(22, 2), at(22, 4))
    assert "(now Sun 2026-11-22 02:30 UTC;" in may_start_drain(SUNDAY, saturday_night_in_brazil, 60)[1]


@pytest.mark.parametrize("call", [
    lambda naive: SUNDAY.opening_at(naive),
    lambda naive: SUNDAY.next_opening(naive),
    lambda naive: SUNDAY.previous_opening(naive),
    lambda naive: SUNDAY.seconds_left(naive),
    lambda naive: may_start_drain(SUNDAY, naive, 60),
])
def test_naive_datetimes_are_refused(call: Callable[[datetime], object]) -> None:
    with pytest.raises(ChangeoverError, match="it has no time zone, and drain windows are in UTC"):
        call(datetime(2026, 11, 22, 3, 0))


# --- may_start_drain -------------------------------------------------------------------------------------------


def test_drain_may_start_inside_with_enough_time_left() -> None:
    allowed, reason = may_start_drain(SUNDAY, at(22, 2, 30), 600)
    assert allowed
    assert reason == ("inside the drain window SUN 02:00-04:00 UTC with 5400 s left "
                      "(now Sun 2026-11-22 02:30 UTC; closes 04:00 UTC)")


def test_drain_may_start_with_exactly_the_time_it_needs() -> None:
    assert may_start_drain(SUNDAY, at(22, 3, 50), 600)[0]
    assert not may_start_drain(SUNDAY, at(22, 3, 50, 1), 600)[0]


def test_drain_outside_the_window_is_refused_naming_the_next_opening() -> None:
    assert may_start_drain(SUNDAY, at(21, 10), 600) == (
        False,
        "outside the drain window SUN 02:00-04:00 UTC "
        "(now Sat 2026-11-21 10:00 UTC; next opens Sun 2026-11-22 02:00 UTC)",
    )
    assert not may_start_drain(SUNDAY, at(22, 4), 0)[0]  # the close itself is outside


def test_drain_with_too_little_time_left_is_refused_naming_the_close() -> None:
    assert may_start_drain(SUNDAY, at(22, 3, 58), 600) == (
        False,
        "only 120 s of the drain window SUN 02:00-04:00 UTC remain (now Sun 2026-11-22 03:58 UTC; closes 04:00 UTC), "
        "and a drain needs 600 s",
    )


def test_close_after_midnight_is_named_with_its_date() -> None:
    allowed, reason = may_start_drain(MIDNIGHT, at(22, 23, 55), 7200)
    assert not allowed
    assert "(now Sun 2026-11-22 23:55 UTC; closes Mon 2026-11-23 01:00 UTC)" in reason
    allowed, reason = may_start_drain(MIDNIGHT, at(23, 0, 10), 60)
    assert allowed
    assert reason.endswith("(now Mon 2026-11-23 00:10 UTC; closes 01:00 UTC)")


def test_drain_longer_than_the_whole_window_says_no_start_time_would_do() -> None:
    allowed, reason = may_start_drain(SUNDAY, at(22, 2), 9000)
    assert not allowed
    assert reason.endswith("; the whole window lasts only 7200 s, so widen the window or shorten the drain")
    assert "whole window" not in may_start_drain(SUNDAY, at(22, 3, 58), 600)[1]


def test_negative_drain_time_is_refused() -> None:
    with pytest.raises(ChangeoverError, match=r"^drain time -1 s: it is negative\. "):
        may_start_drain(SUNDAY, at(22, 3), -1)


# --- the Airflow timetable -------------------------------------------------------------------------------------


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[datetime]:
    """The scheduler's "now", fixed; tests set clock[0]."""
    now = [at(1, 0, month=1)]
    monkeypatch.setattr(timetables, "_utcnow", lambda: now[0])
    return now


def window_run(opens: datetime, closes: datetime) -> DagRunInfo:
    return DagRunInfo(run_after=pendulum.instance(opens), data_interval=DataInterval(pendulum.instance(opens),
                                                                                      pendulum.instance(closes)))


def last_run(day: int) -> DataInterval:
    return DataInterval(pat(day, 2), pat(day, 4))


TIMETABLE = DrainWindowTimetable("SUN 02:00-04:00")


def test_timetable_runs_at_the_opening_with_the_window_as_data_interval(clock: list[datetime]) -> None:
    info = TIMETABLE.next_dagrun_info(last_automated_data_interval=None,
                                      restriction=TimeRestriction(pat(18, 0), None, catchup=True))
    assert info == window_run(at(22, 2), at(22, 4))
    assert info.run_after == info.data_interval.start == info.logical_date  # run at the opening, not the close
    assert isinstance(info.run_after, pendulum.DateTime)
    assert isinstance(info.data_interval.end, pendulum.DateTime)


def test_timetable_with_catchup_starts_at_earliest_inclusive_whatever_now(clock: list[datetime]) -> None:
    clock[0] = at(10, 12, month=12)
    assert TIMETABLE.next_dagrun_info(last_automated_data_interval=None, restriction=TimeRestriction(
        pat(22, 2), None, catchup=True)) == window_run(at(22, 2), at(22, 4))
    assert TIMETABLE.next_dagrun_info(last_automated_data_interval=None, restriction=TimeRestriction(
        pat(22, 2, 1), None, catchup=True)) == window_run(at(29, 2), at(29, 4))


def test_timetable_with_catchup_runs_every_missed_window_in_turn(clock: list[datetime]) -> None:
    clock[0] = at(10, 12, month=12)
    restriction = TimeRestriction(pat(1, 0), pat(29, 2), catchup=True)
    opened: list[datetime] = []
    last: DataInterval | None = None
    while (info := TIMETABLE.next_dagrun_info(last_automated_data_interval=last, restriction=restriction)) is not None:
        opened.append(info.run_after)
        last = info.data_interval
        assert len(opened) < 10, "latest was not honoured"
    assert opened == [at(1, 2), at(8, 2), at(15, 2), at(22, 2), at(29, 2)]  # latest is inclusive


def test_timetable_with_catchup_and_no_start_date_waits_for_the_next_window(clock: list[datetime]) -> None:
    restriction = TimeRestriction(None, None, catchup=True)
    clock[0] = at(21, 10)
    assert TIMETABLE.next_dagrun_info(last_automated_data_interval=None,
                                      restriction=restriction) == window_run(at(22, 2), at(22, 4))
    clock[0] = at(22, 3)  # inside a window: that window still has an hour
    assert TIMETABLE.next_dagrun_info(last_automated_data_interval=None,
                                      restriction=restriction) == window_run(at(22, 2), at(22, 4))


def test_timetable_without_catchup_skips_windows_that_already_closed(clock: list[datetime]) -> None:
    clock[0] = at(25, 10)  # Wednesday: the 22nd's window was missed and is over
    info = TIMETABLE.next_dagrun_info(last_automated_data_interval=last_run(15),
                                      restriction=TimeRestriction(pat(1, 0), None, catchup=False))
    assert info == window_run(at(29, 2), at(29, 4))
    # With catchup the missed window is run.
    info = TIMETABLE.next_dagrun_info(last_automated_data_interval=last_run(15),
                                      restriction=TimeRestriction(pat(1, 0), None, catchup=True))
    assert info == window_run(at(22, 2), at(22, 4))


def test_timetable_without_catchup_still_runs_the_window_that_is_open_now(clock: list[datetime]) -> None:
    clock[0] = at(22, 3)
    info = TIMETABLE.next_dagrun_info(last_automated_data_interval=last_run(1),
                                      restriction=TimeRestriction(pat(1, 0), None, catchup=False))
    assert info == window_run(at(22, 2), at(22, 4))


def test_timetable_without_catchup_does_not_repeat_the_window_just_run(clock: list[datetime]) -> None:
    clock[0] = at(22, 2, 0, 5)  # the scheduler asks again right after creating the run for this window
    info = TIMETABLE.next_dagrun_info(last_automated_data_interval=last_run(22),
                                      restriction=TimeRestriction(pat(1, 0), None, catchup=False))
    assert info == window_run(at(29, 2), at(29, 4))


def test_timetable_without_catchup_waits_for_a_future_start_date(clock: list[datetime]) -> None:
    clock[0] = at(22, 3)
    info = TIMETABLE.next_dagrun_info(last_automated_data_interval=None,
                                      restriction=TimeRestriction(pat(1, 0, month=12), None, catchup=False))
    assert info == window_run(at(6, 2, month=12), at(6, 4, month=12))


def test_timetable_stops_after_latest(clock: list[datetime]) -> None:
    clock[0] = at(21, 10)
    for catchup in (True, False):
        assert TIMETABLE.next_dagrun_info(last_automated_data_interval=last_run(15),
                                          restriction=TimeRestriction(pat(1, 0), pat(22, 1), catchup)) is None
        assert TIMETABLE.next_dagrun_info(last_automated_data_interval=last_run(15),
                                          restriction=TimeRestriction(pat(1, 0), pat(22, 2), catchup)) is not None


def test_timetable_for_a_window_crossing_midnight(clock: list[datetime]) -> None:
    clock[0] = at(20, 12)
    info = DrainWindowTimetable("SUN 23:00-01:00").next_dagrun_info(
        last_automated_data_interval=None, restriction=TimeRestriction(None, None, catchup=False))
    assert info == window_run(at(22, 23), at(23, 1))


def test_manual_run_gets_the_open_window_or_an_empty_interval() -> None:
    assert TIMETABLE.infer_manual_data_interval(run_after=pat(22, 3)) == DataInterval(pat(22, 2), pat(22, 4))
    assert TIMETABLE.infer_manual_data_interval(run_after=pat(21, 10)) == DataInterval(pat(21, 10), pat(21, 10))


def test_timetable_summary_and_description() -> None:
    assert TIMETABLE.summary == "drain window SUN 02:00-04:00 UTC"
    assert TIMETABLE.description == "When the drain window opens: Sun at 02:00 UTC, for 120 min"
    assert DrainWindowTimetable("sat,sun 01:00-03:30").summary == "drain window SAT,SUN 01:00-03:30 UTC"


def test_timetable_refuses_a_bad_window_when_the_dag_is_parsed() -> None:
    with pytest.raises(ChangeoverError, match="unknown day 'SUNDAY'"):
        DrainWindowTimetable("SUNDAY 02:00-04:00")


def test_serialize_deserialize_round_trip() -> None:
    timetable = DrainWindowTimetable("sat,sun 23:00-01:30")
    data = timetable.serialize()
    assert data == {"window": "SAT,SUN 23:00-01:30"}
    restored = DrainWindowTimetable.deserialize(data)
    assert isinstance(restored, DrainWindowTimetable)
    assert restored == timetable
    assert restored.window == DrainWindow.parse("SAT,SUN 23:00-01:30")
    assert restored != TIMETABLE


def test_airflow_serializes_the_timetable_registered_by_the_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow import plugins_manager
    from airflow.serialization.decoders import decode_timetable
    from airflow.serialization.encoders import encode_timetable

    # Airflow only (de)serializes custom timetables that a plugin registers; register exactly the plugin's list.
    registered = {f"{cls.__module__}.{cls.__qualname__}": cls for cls in ChangeoverPlugin.timetables}
    monkeypatch.setattr(plugins_manager, "get_timetables_plugins", lambda: registered)
    encoded = encode_timetable(TIMETABLE)
    assert encoded["__type"] == "changeover_airflow.timetables.DrainWindowTimetable"
    assert decode_timetable(encoded) == TIMETABLE
