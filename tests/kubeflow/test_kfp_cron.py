"""Six-field cron validation (seconds first) for KFP recurring runs: accepted forms, what they fire on,
and a clear error for every malformed schedule (naming the field and why)."""

from __future__ import annotations

import datetime as dt

import pytest

from sao_core.kfp.cron import CronError, parse_cron, validate_cron

UTC = dt.UTC


def test_daily_at_two_fires_at_two_every_day():
    schedule = parse_cron("0 0 2 * * *")
    assert schedule.next_times(dt.datetime(2026, 3, 1, 2, 0, 0, tzinfo=UTC), 3) == [
        dt.datetime(2026, 3, 2, 2, 0, tzinfo=UTC), dt.datetime(2026, 3, 3, 2, 0, tzinfo=UTC),
        dt.datetime(2026, 3, 4, 2, 0, tzinfo=UTC)]
    assert schedule.matches(dt.datetime(2026, 3, 1, 2, 0, 0)) and not schedule.matches(dt.datetime(2026, 3, 1, 2, 0, 1))


def test_lists_ranges_steps_and_names():
    schedule = parse_cron("30 */15 9-17/4 * jan-MAR,Dec MON-FRI")
    assert schedule.seconds == {30} and schedule.minutes == {0, 15, 30, 45} and schedule.hours == {9, 13, 17}
    assert schedule.months == {1, 2, 3, 12} and schedule.days_of_week == {1, 2, 3, 4, 5}
    # Saturday 2026-01-03 is skipped, Monday 2026-01-05 09:00:30 is the next firing.
    assert schedule.next_times(dt.datetime(2026, 1, 2, 17, 45, 30), 1) == [dt.datetime(2026, 1, 5, 9, 0, 30)]
    assert parse_cron("0 5/20 * * * *").minutes == {5, 25, 45}  # a/n: from a to the field's maximum


def test_day_fields_or_when_both_restricted_and_when_one_is_star():
    either = parse_cron("0 0 0 1 * SUN")  # the 1st of the month OR a Sunday
    assert either.day_matches(dt.date(2026, 4, 1)) and either.day_matches(dt.date(2026, 4, 5))
    assert not either.day_matches(dt.date(2026, 4, 6))
    only_dom = parse_cron("0 0 0 1 * ?")
    assert only_dom.day_matches(dt.date(2026, 4, 1)) and not only_dom.day_matches(dt.date(2026, 4, 5))


def test_validate_normalises_whitespace():
    assert validate_cron("  0  0 2 *\t* *  ") == "0 0 2 * * *"


@pytest.mark.parametrize("expression, fragments", [
    ("0 2 * * *", ["5 fields", "seconds first", "Did you mean '0 0 2 * * *'"]),
    ("0 0 2 * * * 2026", ["7 fields", "exactly six"]),
    ("", ["empty"]),
    ("@daily", ["descriptors", "0 0 2 * * *"]),
    ("60 * * * * *", ["field 1 (seconds)", "60", "0-59"]),
    ("0 60 * * * *", ["field 2 (minutes)", "0-59"]),
    ("0 0 24 * * *", ["field 3 (hours)", "0-23"]),
    ("0 0 0 0 * *", ["field 4 (day-of-month)", "1-31"]),
    ("0 0 0 1 13 *", ["field 5 (month)", "1-12"]),
    ("0 0 0 * * 7", ["field 6 (day-of-week)", "Sunday is 0"]),
    ("0 0 0 * FOO *", ["field 5 (month)", "'FOO'", "JAN"]),
    ("0 0 0 * * MONDAY", ["field 6 (day-of-week)", "'MONDAY'"]),
    ("0 0 5-1 * * *", ["field 3 (hours)", "runs backwards"]),
    ("*/0 * * * * *", ["field 1 (seconds)", "step '0'"]),
    ("*/x * * * * *", ["step 'x'"]),
    ("*/61 * * * * *", ["larger than the field's range"]),
    ("0 0 0 1,,2 * *", ["empty list item"]),
    ("? * * * * *", ["'?' is only allowed"]),
    ("0 0 0 30 2 *", ["never occurs", "month(s) [2]"]),
    ("0 0 -1 * * *", ["field 3 (hours)"]),
])
def test_bad_schedules_are_refused_with_the_field_and_the_reason(expression, fragments):
    with pytest.raises(CronError) as info:
        validate_cron(expression)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_non_string_is_refused():
    with pytest.raises(CronError, match="empty"):
        validate_cron(None)  # type: ignore[arg-type]
