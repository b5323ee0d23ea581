"""The pictures' own fields: typed on first sight (ISO date, number, string), a value of another type refused in one
line naming the field and the row, dates kept as UTC seconds covering their day or second."""

import pytest

from cfir_jax.core.errors import CfirError
from cfir_jax.core.picture_fields import DATE, DAY, NUMBER, STRING, FieldTypes, date_span, kind_of, value_of


@pytest.mark.parametrize("value, kind", [
    ("2020-06-30", DATE), ("2020-06-30T14:05:00Z", DATE), ("2020-06-30 14:05", DATE),
    ("2020-06-30T14:05:00+02:00", DATE), ("2020-13-40", STRING), ("reuters", STRING), ("2020", STRING),
    (3, NUMBER), (2.5, NUMBER), (-1e9, NUMBER),
])
def test_a_value_is_typed_on_sight(value, kind):
    assert kind_of(value) == kind


@pytest.mark.parametrize("value", [True, None, [1, 2], {"a": 1}, float("nan"), float("inf")])
def test_a_value_that_is_not_flat_is_refused(value):
    with pytest.raises(ValueError):
        kind_of(value)


def test_a_date_covers_its_day_and_a_time_its_second_in_utc():
    lo, hi = date_span("1970-01-02")
    assert (lo, hi) == (DAY, 2 * DAY)
    assert date_span("1970-01-02T01:00:00+01:00") == (DAY, DAY + 1)  # the same instant as midnight UTC
    assert value_of(DATE, "1970-01-02T00:00:00Z") == DAY and value_of(NUMBER, 3) == 3.0
    with pytest.raises(ValueError, match="not an ISO 8601 date"):
        date_span("yesterday")


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
    with pytest.raises(CfirError, match="x:2: field 'tags': list"):
        types.check("x:2", {"tags": ["a"]})
    with pytest.raises(CfirError, match="field name 'a b' must be a word"):
        types.check("x:3", {"a b": 1})
