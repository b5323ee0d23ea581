"""Filters on the images' own fields: each line parsed or refused in one line, and its mask over a column store
equal to the same condition written out by hand (hypothesis over columns and conditions); the call's rows narrowed
for the length of a block, in that thread alone."""

import datetime as dt
import inspect
import operator
import re
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cfir_jax.builders.image_fields import columns_of, concat
from cfir_jax.core.image_field_types import FieldTypes
from cfir_jax.core.query_rule import conditions
from cfir_jax.retrieve.filters import Condition, Filter, FilterError, RowFilter, parse
from cfir_jax.search import live_rows
from cfir_jax.search.live_rows import LiveRows

QUICK = settings(max_examples=150, deadline=None, database=None)
OPS = {"=": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le, ">": operator.gt,
       ">=": operator.ge}


@pytest.mark.parametrize("line, cond", [
    ("date<=2020-06-30", Condition("date", "<=", ("2020-06-30",))),
    (" source = reuters ", Condition("source", "=", ("reuters",))),
    ("license in cc-by, cc0", Condition("license", "in", ("cc-by", "cc0"))),
    ("n!=3", Condition("n", "!=", ("3",))),
    ("title='a b'", Condition("title", "=", ("a b",))),
    (("license", "in", ["cc-by", "cc0"]), Condition("license", "in", ("cc-by", "cc0"))),
    (("width", ">", 100), Condition("width", ">", ("100",))),
])
def test_a_filter_line_or_triple_is_parsed(line, cond):
    assert parse(line) == cond
    assert parse(str(cond)) == cond  # its line reads back as itself


@pytest.mark.parametrize("line, says", [
    ("source~reuters", "expected FIELD OP VALUE"), ("date<=", "no value"), ("=x", "expected FIELD OP VALUE"),
    ("license in a,,b", "no value"), (42, "give a string"), (("a", "like", "b"), "unknown operator 'like'"),
])
def test_a_malformed_filter_is_one_line(line, says):
    with pytest.raises(FilterError, match=says) as e:
        parse(line)
    assert "\n" not in str(e.value)


class Store:
    def __init__(self, rows, kinds=None, zone="UTC"):
        self.columns, self.num_rows = columns_of(rows, FieldTypes(kinds).kinds, zone), len(rows)


def _day(n: int) -> str:
    return (dt.date(2020, 1, 1) + dt.timedelta(days=n)).isoformat()


TAGS = ["a", "b", "c", "d"]
ROWS = st.lists(st.fixed_dictionaries({}, optional={
    "date": st.integers(0, 30).map(_day), "n": st.integers(-5, 5), "s": st.sampled_from(["a", "b", "c"]),
    "tags": st.one_of(st.lists(st.sampled_from(TAGS[:3]), max_size=3), st.sampled_from(TAGS[:3])),
    "flag": st.booleans()}), min_size=1, max_size=30)
KINDS = {"date": "date", "n": "number", "s": "string", "tags": "list", "flag": "boolean"}


def _by_hand(row: dict, field: str, op: str, values: list) -> bool:
    """The condition written out: ISO dates compare as strings; a list holds a value or not (a lone string is a list
    of one); an image without the field fails."""
    if field not in row:
        return False
    if field == "tags":
        held = {row["tags"]} if isinstance(row["tags"], str) else set(row["tags"])
        return (values[0] not in held) if op == "!=" else bool(held & set(values))
    if op == "in":
        return any(row[field] == v for v in values)
    return OPS[op](row[field], values[0])


@QUICK
@given(rows=ROWS, field=st.sampled_from(sorted(KINDS)), op=st.sampled_from([*OPS, "in"]),
       picks=st.lists(st.integers(0, 30), min_size=1, max_size=3))
def test_a_mask_equals_the_condition_written_out(rows, field, op, picks):
    if field in ("tags", "flag") and op not in ("=", "!=", "in"):
        op = "="  # an order on a list or a boolean is refused (below)
    value_of = {"date": _day, "n": lambda p: p % 11 - 5, "s": lambda p: "abcd"[p % 4], "tags": lambda p: TAGS[p % 4],
                "flag": lambda p: p % 2 == 0}[field]
    values = [value_of(p) for p in picks] if op == "in" else [value_of(picks[0])]
    store = Store(rows, KINDS)
    said = [str(v).lower() if field == "flag" else str(v) for v in values]
    line = f"{field} in {','.join(said)}" if op == "in" else f"{field}{op}{said[0]}"
    mask = Filter([line]).mask(store)
    assert mask.tolist() == [_by_hand(r, field, op, values) for r in rows], line


def test_a_date_alone_covers_its_day_and_filters_join_by_and():
    rows = [{"date": "2020-06-30T18:00:00Z", "s": "ap"}, {"date": "2020-07-01", "s": "ap"},
            {"date": "2020-06-29", "s": "afp"}, {"s": "ap"}]
    store = Store(rows)
    assert Filter(["date<=2020-06-30"]).mask(store).tolist() == [True, False, True, False]
    assert Filter(["date=2020-06-30"]).mask(store).tolist() == [True, False, False, False]
    assert Filter(["date>2020-06-30"]).mask(store).tolist() == [False, True, False, False]
    assert Filter(["date<=2020-06-30", "s=ap"]).mask(store).tolist() == [True, False, False, False]
    assert Filter(["s!=afp"]).mask(store).tolist() == [True, True, False, True]
    with pytest.raises(FilterError, match=r"^filter 'x=1': unknown field 'x' \(the images' fields: date, s\)$"):
        Filter(["x=1"]).mask(store)
    with pytest.raises(FilterError, match="date is a date; 'soon' is not an ISO 8601 date"):
        Filter(["date<soon"]).mask(store)


def test_a_date_covers_its_span_at_its_own_precision_in_the_index_zone():
    rows = [{"date": "2020-06-30T14:05:30Z"}, {"date": "2020-06-30T21:00-04:00"}, {"date": "2020-07-01"}]
    store = Store(rows)
    for line, passing in [
        ("date=2020-06-30T14:05", [True, False, False]), ("date<=2020-06-30T14:05", [True, False, False]),
        ("date>2020-06-30T14:05", [False, True, True]), ("date=2020-06", [True, False, False]),
        ("date=2020", [True, True, True]), ("date<2020-07", [True, False, False]),
        ("date=2020-06-30T14:05:30", [True, False, False]), ("date>=2020-07-01T01", [False, True, False]),
    ]:
        assert Filter([line]).mask(store).tolist() == passing, line
    # In New York the evening of June 30 is June 30, and so is a date without a time read there.
    ny = Store(rows, zone="America/New_York")
    assert Filter(["date<=2020-06-30"]).mask(ny).tolist() == [True, True, False]
    assert Filter(["date=2020-06-30"]).mask(ny).tolist() == [True, True, False]
    assert Filter(["date=2020-07-01"]).mask(ny).tolist() == [False, False, True]
    assert Filter(["date<=2020-06-30"]).mask(store).tolist() == [True, False, False]  # in UTC it is July 1


def test_lists_and_booleans_filter_as_archives_mean_them():
    rows = [{"tags": ["news", "sport"], "featured": True}, {"tags": "sport", "featured": False}, {"tags": []},
            {"featured": True}]
    store = Store(rows)
    for line, passing in [
        ("tags=sport", [True, True, False, False]), ("tags!=sport", [False, False, True, False]),
        ("tags in news,weather", [True, False, False, False]), ("tags=weather", [False] * 4),
        ("featured=true", [True, False, False, True]), ("featured=False", [False, True, False, False]),
        ("featured!=true", [False, True, False, False]), ("featured in true,false", [True, True, False, True]),
    ]:
        assert Filter([line]).mask(store).tolist() == passing, line
    for line, says in [("tags<=b", "tags is a list of strings (a list holds a value or not); use =, != or in, not <="),
                       ("featured>false", "featured is true or false; use =, != or in, not >"),
                       ("featured=yes", "featured is true or false, 'yes' is neither")]:
        with pytest.raises(FilterError, match=f"^filter '{line}': {re.escape(says)}$"):
            Filter([line]).mask(store)


def test_an_addition_keeps_the_columns_right():
    old = [{"s": "ap", "n": 1, "tags": ["x", "y"]}, {"s": "afp", "on": False}]
    new = [{"s": "reuters", "credit": "desk", "tags": "z"}, {"s": "ap", "n": 2, "tags": ["y"], "on": True}]
    joined = concat(Store(old).columns, Store(new, {"tags": "list"}).columns, 2, 2)  # the collection's types
    whole = Store(old + new)
    assert sorted(joined) == sorted(whole.columns)
    for name in ("s", "n", "credit", "tags", "on"):
        s = Store.__new__(Store)
        s.columns, s.num_rows = joined, 4
        for line in {"s": ["s=ap", "s in afp,reuters"], "n": ["n>=1"], "credit": ["credit=desk"],
                     "tags": ["tags=y", "tags in x,z", "tags!=x"], "on": ["on=true", "on!=true"]}[name]:
            assert Filter([line]).mask(s).tolist() == Filter([line]).mask(whole).tolist(), line


def test_a_calls_rows_are_an_argument_each_filter_group_gets_its_own():
    """The rows a filtered call may return are what `RowFilter.run` hands its retrieval, per group of one filter:
    the base rows narrowed by that filter, never state another call (a thread beside it) could see."""
    base = LiveRows(np.array([False, True, False, False]), 4)  # row 1 removed
    rows = RowFilter(SimpleNamespace(live=base))
    rows._fields = SimpleNamespace(columns=columns_of([{"s": "a"}, {"s": "a"}, {"s": "b"}, {"s": "a"}],
                                                      FieldTypes(None).kinds), num_rows=4)
    seen = {}

    def retrieve(part, live):
        seen[part[0].where] = live.keep(np.arange(4)).tolist()
        return [SimpleNamespace(note="") for _ in part]

    docs = [SimpleNamespace(where=conditions(["s=a"])), SimpleNamespace(where=())]
    rows.run(docs, base, retrieve, lambda note, n: [])
    assert seen == {conditions(["s=a"]): [0, 3], (): [0, 2, 3]}
    assert base.keep(np.arange(4)).tolist() == [0, 2, 3]  # the base rows are untouched
    assert not any("contextvars" in line for line in inspect.getsource(live_rows).splitlines())


# a field name has no space, operator or comma (`parse_line`'s); a value is any text without a control character (which
# a note escapes) or a lone surrogate (which is refused), spaces alone included
_FIELD = st.text(st.characters(blacklist_categories=("Cc", "Cs", "Zs", "Zl", "Zp"), blacklist_characters="=<>!,"),
                 min_size=1, max_size=8)
_VALUE = st.text(st.characters(blacklist_categories=("Cc", "Cs")), min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(field=_FIELD, op=st.sampled_from(["=", "!=", "<", "<=", ">", ">="]), value=_VALUE)
def test_a_comparisons_line_as_a_note_writes_it_reads_back_as_it_whatever_its_value(field, op, value):
    """A note names a condition as a line (`str`): its value quoted where a line would read it otherwise (outer
    spaces or quotes, a leading '=', a ';'), so that a person who copies the line filters on the same value."""
    cond = Condition(field, op, (value,))
    assert parse(str(cond)) == cond, str(cond)


@settings(max_examples=200, deadline=None)
@given(field=_FIELD, values=st.lists(_VALUE.filter(lambda v: "," not in v), min_size=1, max_size=4))
def test_an_in_lists_line_reads_back_as_it_where_no_value_holds_a_comma(field, values):
    cond = Condition(field, "in", tuple(values))
    assert parse(str(cond)) == cond, str(cond)
