"""The images' own fields: typed on first sight (ISO date, number, string, boolean, list of strings), a value of
another type refused in one line naming the field and the row; dates kept as UTC seconds, each covering its span at
its own precision (a year ... a second), read in the index's zone unless it carries an offset."""

import datetime as dt
import zoneinfo

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from cfir_jax.core.errors import CfirError
from cfir_jax.core.image_field_types import (
    BOOLEAN,
    DATE,
    DAY,
    LIST,
    NUMBER,
    STRING,
    FieldTypes,
    date_span,
    kind_of,
    value_of,
    zone_of,
)


@pytest.mark.parametrize("value, kind", [
    ("2020-06-30", DATE), ("2020-06-30T14:05:00Z", DATE), ("2020-06-30 14:05", DATE),
    ("2020-06-30T14:05:00+02:00", DATE), ("2020-13-40", STRING), ("reuters", STRING), ("2020", STRING),
    ("2020-06", STRING), (3, NUMBER), (2.5, NUMBER), (-1e9, NUMBER), (True, BOOLEAN), (False, BOOLEAN),
    (["news", "sport"], LIST), ([], LIST), (["a", None], LIST),
])
def test_a_value_is_typed_on_sight(value, kind):
    assert kind_of(value) == kind


@pytest.mark.parametrize("value, says", [
    (None, "NoneType None is not a field value"), ([1, 2], "holds int 1; a list field holds strings"),
    (["a", {"b": 1}], "holds dict"), ({"a": 1}, "dict {'a': 1} is not a field value"),
    (float("nan"), "not a finite number"), (float("inf"), "not a finite number"),
])
def test_a_nested_value_or_a_list_of_non_strings_is_refused(value, says):
    with pytest.raises(ValueError, match=says):
        kind_of(value)


def test_a_date_covers_its_span_at_its_own_precision():
    assert date_span("1970-01-02") == (DAY, 2 * DAY)
    assert date_span("1970") == (0, 365 * DAY) and date_span("1970-02") == (31 * DAY, 59 * DAY)
    assert date_span("1970-01-02T01") == (DAY + 3600, DAY + 7200)
    assert date_span("1970-01-02T00:01") == (DAY + 60, DAY + 120)
    assert date_span("1970-01-02T00:00:05.75") == (DAY + 5, DAY + 6)
    assert date_span("1970-01-02T01:00:00+01:00") == (DAY, DAY + 1)  # the same instant as midnight UTC
    assert value_of(DATE, "1970-01-02T00:00:00Z") == DAY and value_of(NUMBER, 3) == 3.0
    for bad in ("yesterday", "2020-02-30", "2020-6", "2020-06-30Z"):
        with pytest.raises(ValueError, match="not an ISO 8601 date"):
            date_span(bad)


def test_a_date_without_an_offset_is_read_in_the_zone_and_one_with_an_offset_keeps_it():
    evening = value_of(DATE, "2020-06-30T21:00-04:00")  # June 30 in New York, July 1 in UTC
    lo, hi = date_span("2020-06-30", "America/New_York")
    assert lo <= evening < hi and not date_span("2020-06-30")[0] <= evening < date_span("2020-06-30")[1]
    assert date_span("2020-06-30T21:00-04:00", "Asia/Tokyo") == date_span("2020-07-01T01:00Z")
    spring = date_span("2020-03-08", "America/New_York")  # the day clocks go forward: 23 hours
    assert spring[1] - spring[0] == 23 * 3600
    assert value_of(DATE, "2020-06-30", "America/New_York") == lo
    # 01:30 shows twice when clocks go back: the first (EDT, -04:00) is meant; an offset says the second.
    assert date_span("2020-11-01T01:30", "America/New_York") == date_span("2020-11-01T01:30-04:00")
    with pytest.raises(ValueError, match="'Mars/Olympus' is not a known IANA time zone"):
        zone_of("Mars/Olympus")


ZONES = ("UTC", "America/New_York", "Asia/Kolkata", "Europe/Paris", "Australia/Lord_Howe")
# How each precision writes a local time: a year, a month, a day, an hour, a minute, a second.
FORMATS = ("%Y", "%Y-%m", "%Y-%m-%d", "%Y-%m-%dT%H", "%Y-%m-%dT%H:%M", "%Y-%m-%dT%H:%M:%S")


@settings(max_examples=300, deadline=None, database=None)
@given(instant=st.integers(-1_500_000_000, 4_000_000_000), fmt=st.sampled_from(FORMATS),
       zone=st.sampled_from(ZONES), own=st.sampled_from(ZONES))
def test_a_filter_at_an_images_own_precision_covers_it(instant, fmt, zone, own):
    """An image taken at `instant` (written with its own zone's offset), and a filter value of that instant at any
    precision, written without an offset in the index's zone: `=` and `<=` hold, `>=` too, `>` and `<` do not."""
    when = dt.datetime.fromtimestamp(instant, dt.UTC)
    image = value_of(DATE, when.astimezone(zoneinfo.ZoneInfo(own)).isoformat(), zone)
    assert image == instant
    local = when.astimezone(zone_of(zone))
    # A clock time that a daylight-saving change shows twice is read as its first showing (docs/filters.md).
    assume(local.fold == 0 or FORMATS.index(fmt) < 3)
    lo, hi = date_span(local.strftime(fmt), zone)
    assert lo <= image < hi  # `=`, `<=` (image < hi), `>=` (image >= lo); so neither `>` nor `<`


def test_a_conflicting_type_is_one_line_naming_the_field_and_the_row():
    types = FieldTypes()
    assert types.check("images.jsonl:1", {"date": "2020-01-01", "source": "ap", "n": 3, "gone": None}) == \
        {"date": "2020-01-01", "source": "ap", "n": 3}
    with pytest.raises(CfirError) as e:
        types.check("images.jsonl:7", {"date": "last week"})
    assert str(e.value) == ("images.jsonl:7: field 'date' is a string ('last week') but earlier rows made it a date; "
                            "give every row's 'date' as a date")
    with pytest.raises(CfirError, match="images.jsonl:8: field 'n' is a string"):
        types.check("images.jsonl:8", {"n": "three"})
    # A string field may hold a string that looks like a date; the collection's types carry over (an addition).
    assert types.check("x:9", {"source": "2020-01-01"}) == {"source": "2020-01-01"}
    with pytest.raises(CfirError, match="x:1: field 'n' is a string"):
        FieldTypes(types.kinds).check("x:1", {"n": "4"})
    with pytest.raises(CfirError, match="field name 'a b' must be a word"):
        types.check("x:3", {"a b": 1})


def test_lists_and_booleans_are_fields_and_a_lone_string_in_a_list_field_is_a_list_of_one():
    types = FieldTypes()
    row = {"tags": ["news", "sport"], "featured": False, "people": [], "credit": "desk"}
    assert types.check("x:1", row) == row
    assert types.kinds == {"tags": LIST, "featured": BOOLEAN, "people": LIST, "credit": STRING}
    assert types.check("x:2", {"tags": "sport", "people": "2020-01-01"}) == {"tags": "sport", "people": "2020-01-01"}
    assert value_of(LIST, "sport") == ["sport"] and value_of(LIST, ["a", None, "b"]) == ["a", "b"]
    for line, fields, says in [
        ("x:3", {"featured": 1}, "x:3: field 'featured' is a number (1) but earlier rows made it a boolean"),
        ("x:4", {"credit": ["a"]}, "x:4: field 'credit' is a list (['a']) but earlier rows made it a string"),
        ("x:5", {"tags": [1]}, "x:5: field 'tags': list [1] holds int 1; a list field holds strings"),
        ("x:6", {"meta": {"a": 1}}, "x:6: field 'meta': dict {'a': 1} is not a field value"),
    ]:
        with pytest.raises(CfirError, match=f"^{line}") as e:
            types.check(line, fields)
        assert str(e.value).startswith(says) and "\n" not in str(e.value)
