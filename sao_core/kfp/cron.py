"""Six-field cron expressions as the KFP scheduler reads them: seconds first.

KFP's recurring runs use ``seconds minutes hours day-of-month month day-of-week``. A classic
five-field crontab line is *not* an error for the server: it reads ``0 2 * * *`` as "second 0 of
minute 2 of every hour" (day-of-week optional), so a job meant for 02:00 daily runs 24 times a day.
:func:`validate_cron` therefore refuses five-field strings (and suggests the six-field form) and
every other malformed schedule, naming the field and the reason, before any request is sent.

Per field: ``*`` (``?`` also in the two day fields), numbers, names (``JAN``-``DEC``, ``SUN``-``SAT``,
any case), ranges ``a-b``, steps ``*/n``, ``a-b/n``, ``a/n`` (from a to the field's maximum), and
comma-separated lists of those. Day of week is 0-6 with 0 = Sunday (7 is refused: the server's
parser does not accept it). When both day fields are restricted a day matches if either matches
(classic cron semantics).
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass

FIELDS = (
    ("seconds", 0, 59, {}),
    ("minutes", 0, 59, {}),
    ("hours", 0, 23, {}),
    ("day-of-month", 1, 31, {}),
    ("month", 1, 12, {name: i + 1 for i, name in enumerate(
        ["JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC"])}),
    ("day-of-week", 0, 6, {name: i for i, name in enumerate(["SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"])}),
)
FORMAT = "seconds minutes hours day-of-month month day-of-week"


class CronError(ValueError):
    """A schedule the KFP scheduler would refuse or misread; the message names the field and why."""


@dataclass(frozen=True)
class CronSchedule:
    """A parsed six-field expression: the allowed values of each field."""

    expression: str
    seconds: frozenset[int]
    minutes: frozenset[int]
    hours: frozenset[int]
    days_of_month: frozenset[int]
    months: frozenset[int]
    days_of_week: frozenset[int]
    dom_restricted: bool
    dow_restricted: bool

    def day_matches(self, day: _dt.date) -> bool:
        """True if the schedule fires on `day` (at some time)."""
        if day.month not in self.months:
            return False
        dom = day.day in self.days_of_month
        dow = (day.isoweekday() % 7) in self.days_of_week
        if self.dom_restricted and self.dow_restricted:
            return dom or dow
        return dom and dow

    def matches(self, when: _dt.datetime) -> bool:
        """True if the schedule fires at `when` (to the second)."""
        return (self.day_matches(when.date()) and when.hour in self.hours and when.minute in self.minutes
                and when.second in self.seconds)

    def next_times(self, after: _dt.datetime, count: int = 3, horizon_days: int = 5 * 366) -> list[_dt.datetime]:
        """The next `count` firing times strictly after `after` (same tzinfo), within `horizon_days`."""
        found: list[_dt.datetime] = []
        day = after.date()
        for _ in range(horizon_days + 1):
            if self.day_matches(day):
                for hour in sorted(self.hours):
                    for minute in sorted(self.minutes):
                        for second in sorted(self.seconds):
                            moment = _dt.datetime(day.year, day.month, day.day, hour, minute, second,
                                                  tzinfo=after.tzinfo)
                            if moment > after:
                                found.append(moment)
                                if len(found) == count:
                                    return found
            day += _dt.timedelta(days=1)
        return found


def _number(text: str, field: int, expression: str) -> int:
    name, low, high, names = FIELDS[field]
    token = text.upper()
    if token in names:
        return names[token]
    if not token.isdigit():
        known = f" or a name ({', '.join(names)})" if names else ""
        raise CronError(f"cron {expression!r}: field {field + 1} ({name}) has {text!r}, expected a number "
                        f"{low}-{high}{known}")
    value = int(token)
    if not low <= value <= high:
        hint = " (Sunday is 0)" if field == 5 and value == 7 else ""
        raise CronError(f"cron {expression!r}: field {field + 1} ({name}) value {value} is out of range "
                        f"{low}-{high}{hint}")
    return value


def _parse_field(text: str, field: int, expression: str) -> tuple[frozenset[int], bool]:
    """(allowed values, restricted?) of one field."""
    name, low, high, _ = FIELDS[field]
    where = f"cron {expression!r}: field {field + 1} ({name})"
    values: set[int] = set()
    for part in text.split(","):
        if not part:
            raise CronError(f"{where} has an empty list item in {text!r}")
        base, slash, step_text = part.partition("/")
        step = 1
        if slash:
            if not step_text.isdigit() or int(step_text) < 1:
                raise CronError(f"{where}: step {step_text!r} in {part!r} must be a whole number >= 1")
            step = int(step_text)
            if step > high - low + 1 and base in ("*", "?"):
                raise CronError(f"{where}: step {step} in {part!r} is larger than the field's range {low}-{high}")
        if base in ("*", "?"):
            if base == "?" and field not in (3, 5):
                raise CronError(f"{where}: '?' is only allowed in day-of-month and day-of-week")
            start, end = low, high
        elif "-" in base:
            first, _, last = base.partition("-")
            start, end = _number(first, field, expression), _number(last, field, expression)
            if start > end:
                raise CronError(f"{where}: range {base!r} runs backwards ({start} > {end})")
        else:
            start = _number(base, field, expression)
            end = high if slash else start
        values.update(range(start, end + 1, step))
    return frozenset(values), text not in ("*", "?")


def parse_cron(expression: str) -> CronSchedule:
    """Parse a six-field expression; :class:`CronError` with the field and the reason if it is wrong."""
    if not isinstance(expression, str) or not expression.strip():
        raise CronError(f"cron schedule is empty; give six fields: {FORMAT} (e.g. '0 0 2 * * *' = 02:00 daily)")
    fields = expression.split()
    if expression.strip().startswith("@"):
        raise CronError(f"cron {expression!r}: descriptors such as @daily are not accepted; write the six fields "
                        f"{FORMAT} (e.g. '0 0 2 * * *' = 02:00 daily)")
    if len(fields) == 5:
        raise CronError(f"cron {expression!r} has 5 fields; KFP reads six fields with seconds first ({FORMAT}), "
                        f"so this would fire at the wrong times. Did you mean '0 {' '.join(fields)}'?")
    if len(fields) != 6:
        raise CronError(f"cron {expression!r} has {len(fields)} fields; KFP needs exactly six: {FORMAT}")
    parsed = [_parse_field(text, i, expression) for i, text in enumerate(fields)]
    schedule = CronSchedule(
        expression=" ".join(fields), seconds=parsed[0][0], minutes=parsed[1][0], hours=parsed[2][0],
        days_of_month=parsed[3][0], months=parsed[4][0], days_of_week=parsed[5][0],
        dom_restricted=parsed[3][1], dow_restricted=parsed[5][1])
    if schedule.dom_restricted and not schedule.dow_restricted:
        possible = {31 if m in (1, 3, 5, 7, 8, 10, 12) else 30 if m != 2 else 29 for m in schedule.months}
        if min(schedule.days_of_month) > max(possible):
            raise CronError(f"cron {expression!r}: day-of-month {sorted(schedule.days_of_month)} never occurs in "
                            f"month(s) {sorted(schedule.months)}, so it would never fire")
    return schedule


def validate_cron(expression: str) -> str:
    """Return the normalised expression (single spaces) or raise :class:`CronError`."""
    return parse_cron(expression).expression
