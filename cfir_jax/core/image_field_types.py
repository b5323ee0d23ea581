"""The images' own fields (`date`, `source`, `tags`, `featured`, ...): their types and values, in one place.

An images file's row may carry fields beside `id`, `path` and the caption (docs/filters.md). Each field is typed on
first sight and keeps that type for the whole collection, additions included:

- `date`: an ISO 8601 date or date-time string (`2020-06-30`, `2020-06-30T14:05:00Z`), kept as UTC seconds; a value
  without an offset is read in the index's zone (`index.fields.timezone`), one with an offset keeps it;
- `number`: a JSON number (not a boolean);
- `boolean`: `true` or `false`;
- `list`: a list of strings (tags, people, keywords); a lone string in a list field is a list of one;
- `string`: any other string.

`null` is no value (the field absent), in a list too. A nested object or a list of anything but strings is refused,
and so is a value of another type than its field's: one line naming the field and the row. The corpus keeps each
image's raw values; the image_fields store (`cfir_jax.stores.image_fields`) keeps them as typed columns; the
filters (`cfir_jax.retrieve.filters`) read dates with the same `date_span`, so a filter's date means what a row's does.
"""

from __future__ import annotations

import datetime as dt
import math
import re
import zoneinfo
from collections.abc import Mapping
from typing import Any

from cfir_jax.core.errors import CfirError

DATE, NUMBER, STRING, BOOLEAN, LIST = "date", "number", "string", "boolean", "list"
KINDS = (DATE, NUMBER, STRING, BOOLEAN, LIST)
DAY = 86400
# A row's string is a date from its day on (YYYY-MM-DD, then an optional time and offset), so a collection's types
# stay what they were: `2020` and `2020-06` in a row are strings. A filter's date may stop at any unit (`_SPAN`).
_ROW_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}([T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}:?\d{2})?)?$")
_SPAN = re.compile(r"^(\d{4})(?:-(\d{2})(?:-(\d{2})(?:[T ](\d{2})(?::(\d{2})(?::(\d{2})(?:\.\d+)?)?)?"
                   r"(Z|[+-]\d{2}(?::?\d{2})?)?)?)?)?$")
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_SECOND = dt.timedelta(seconds=1)
# The span of a value stopped at an hour, a minute or a second, in seconds (a day, a month, a year are counted on
# the calendar of their zone: a day of a daylight-saving change is 23 or 25 hours).
_CLOCK_UNITS = {4: 3600, 5: 60, 6: 1}


def zone_of(name: str) -> dt.tzinfo:
    """The zone an IANA name (`America/New_York`, `UTC`) says; ValueError naming it otherwise."""
    if name == "UTC":
        return dt.UTC
    try:
        return zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"{name!r} is not a known IANA time zone (e.g. 'UTC', 'Europe/Paris', "
                         "'America/New_York')") from None


def kind_of(value: Any) -> str:
    """The type a raw field value has on first sight (KINDS); ValueError for a value no field can hold."""
    if isinstance(value, bool):
        return BOOLEAN
    if isinstance(value, (list, tuple)):
        odd = [v for v in value if v is not None and not isinstance(v, str)]
        if odd:
            raise ValueError(f"list {list(value)!r} holds {type(odd[0]).__name__} {odd[0]!r}; a list field holds "
                             "strings (tags, people, keywords)")
        return LIST
    if not isinstance(value, (int, float, str)):
        raise ValueError(f"{type(value).__name__} {value!r} is not a field value (a string, a number, true or "
                         "false, an ISO date or a list of strings)")
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise ValueError(f"{value!r} is not a finite number")
        return NUMBER
    return DATE if _ROW_DATE.match(value) and _parsed(value) is not None else STRING


def _parsed(text: str) -> tuple[dt.datetime, int, dt.tzinfo | None] | None:
    """(its start as a naive date-time, how many units it gives: 1 a year ... 6 a second, its own zone or None)."""
    found = _SPAN.match(text)
    if found is None:
        return None
    parts = found.groups()[:6]
    units = sum(p is not None for p in parts)
    offset = found.group(7)
    try:
        start = dt.datetime(*(int(p) if p is not None else (1 if j < 3 else 0) for j, p in enumerate(parts)))
        own = None if offset is None else dt.UTC if offset == "Z" else \
            dt.datetime.fromisoformat(f"2000-01-01T00:00{offset}").tzinfo
    except ValueError:
        return None
    return start, units, own


def _next(start: dt.datetime, units: int) -> dt.datetime:
    """The start of the next year, month or day after `start` (wall clock)."""
    if units == 1:
        return start.replace(year=start.year + 1)
    if units == 2:
        return start.replace(year=start.year + start.month // 12, month=start.month % 12 + 1)
    return start + dt.timedelta(days=1)


def date_span(text: str, zone: str = "UTC") -> tuple[int, int]:
    """[start, end) in UTC seconds of an ISO date at its own precision: a year (`2020`), a month (`2020-06`), a day,
    an hour, a minute (`2020-06-30T14:05`) or a second, read in `zone` unless it carries an offset (`Z`,
    `-04:00`; a clock time that a daylight-saving change shows twice is its first showing); ValueError otherwise."""
    parsed = _parsed(text) if isinstance(text, str) else None
    if parsed is None:
        raise ValueError(f"{text!r} is not an ISO 8601 date (YYYY, YYYY-MM, YYYY-MM-DD or "
                         "YYYY-MM-DDTHH:MM[:SS][Z|+HH:MM])")
    start, units, own = parsed
    tz = own or zone_of(zone)
    try:
        lo = (start.replace(tzinfo=tz) - _EPOCH) // _SECOND
        if units in _CLOCK_UNITS:
            return lo, lo + _CLOCK_UNITS[units]
        return lo, (_next(start, units).replace(tzinfo=tz) - _EPOCH) // _SECOND
    except (OverflowError, ValueError):
        raise ValueError(f"{text!r} is out of the range of dates (years 1 to 9998)") from None


def value_of(kind: str, value: Any, zone: str = "UTC") -> float | int | str | bool | list[str]:
    """A raw value of a field of `kind` as its column holds it: UTC seconds (a date, read in `zone` without an
    offset), float (number), bool, a list of strings (a lone string is a list of one), str."""
    if kind == DATE:
        return date_span(value, zone)[0]
    if kind == LIST:
        return [value] if isinstance(value, str) else [v for v in value if v is not None]
    if kind == BOOLEAN:
        return bool(value)
    return float(value) if kind == NUMBER else str(value)


class FieldTypes:
    """The type of each field, fixed by the first row that has it (`known`: the types of an existing collection)."""

    def __init__(self, known: Mapping[str, str] | None = None):
        self.kinds: dict[str, str] = dict(known or {})

    def check(self, where: str, fields: Mapping[str, Any]) -> dict[str, Any]:
        """The row's fields (None values dropped), each held to its field's type; one-line CfirError naming the
        field and `where` (the row) otherwise."""
        out = {}
        for name, value in fields.items():
            if value is None:
                continue
            if not isinstance(name, str) or not name.strip() or any(c in name for c in "=<>!, "):
                raise CfirError(f"{where}: field name {name!r} must be a word without spaces, commas or =<>!")
            try:
                kind = kind_of(value)
            except ValueError as e:
                raise CfirError(f"{where}: field {name!r}: {e}") from None
            first = self.kinds.setdefault(name, kind)
            if isinstance(value, str) and first in (STRING, LIST):  # a date-like string, a lone string of a list
                kind = first
            if kind != first:
                raise CfirError(f"{where}: field {name!r} is a {kind} ({value!r}) but earlier rows made it a {first}; "
                                f"give every row's {name!r} as a {first}")
            out[name] = value
        return out
