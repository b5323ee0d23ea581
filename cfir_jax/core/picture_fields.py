"""The pictures' own fields (`date`, `source`, `license`, ...): their types and values, in one place.

An images file's row may carry flat fields beside `id`, `path` and the caption (docs/filters.md). Each field is typed
on first sight and keeps that type for the whole collection, additions included:

- `date`: an ISO 8601 date or date-time string (`2020-06-30`, `2020-06-30T14:05:00Z`), kept as UTC seconds;
- `number`: a JSON number (not a boolean);
- `string`: any other string.

A value of another type than its field's is refused in one line naming the field and the row. The corpus keeps each
picture's raw values; the image_fields store (`cfir_jax.stores.image_fields`) keeps them as typed columns; the
filters (`cfir_jax.retrieve.filters`) compare with the same `value_of`, so a filter's date means what a row's does.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Mapping
from typing import Any

from cfir_jax.core.errors import CfirError

DATE, NUMBER, STRING = "date", "number", "string"
KINDS = (DATE, NUMBER, STRING)
# Date-only values cover their whole day: a filter `date<=2020-06-30` keeps a picture of 2020-06-30T18:00.
DAY = 86400
_ISO_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}([T ]\d{2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}:?\d{2})?)?$")
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def kind_of(value: Any) -> str:
    """The type a raw field value has on first sight: DATE, NUMBER or STRING (ValueError: not a flat value)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{type(value).__name__} {value!r} is not a flat value (a string, a number or an ISO date)")
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise ValueError(f"{value!r} is not a finite number")
        return NUMBER
    return DATE if _ISO_DATE.match(value) and _seconds(value) is not None else STRING


def _seconds(text: str) -> int | None:
    try:
        when = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return int((when - _EPOCH).total_seconds() // 1)


def date_span(text: str) -> tuple[int, int]:
    """[start, end) in UTC seconds of an ISO date (its whole day) or date-time (its second); ValueError otherwise."""
    if not _ISO_DATE.match(text) or (start := _seconds(text)) is None:
        raise ValueError(f"{text!r} is not an ISO 8601 date (YYYY-MM-DD or YYYY-MM-DDTHH:MM[:SS][Z])")
    return start, start + (DAY if len(text) == 10 else 1)


def value_of(kind: str, value: Any) -> float | int | str:
    """A raw value of a field of `kind` as its column holds it: UTC seconds (date), float (number), str."""
    if kind == DATE:
        return date_span(value)[0]
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
            if first == STRING and isinstance(value, str):  # a string field may hold a date-like string
                kind = STRING
            if kind != first:
                raise CfirError(f"{where}: field {name!r} is a {kind} ({value!r}) but earlier rows made it a {first}; "
                                f"give every row's {name!r} as a {first}")
            out[name] = value
        return out
