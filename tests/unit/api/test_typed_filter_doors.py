"""Issue 61's field types at issue 58's and 59's doors: for random conditions on a list (values with commas, spaces,
quotes, Unicode), a boolean (Python's True and False, "true" and "FALSE" strings) and dates at a year's, a month's, a
day's and a minute's precision (a string, an int year), the library (`Index.search`), the client (JSON triples), the
client through a TLS 1.3 proxy and HTTP's own JSON (triples, and the condition as a line where a line can say it)
answer the same ids: those of the images that pass, written out by hand. A refusal (an order on a list, a boolean
that is neither, a filter past a limit) is the same one line at the library and, with its status, through the client
and the proxy."""

import datetime as dt
import json
import urllib.request

import pytest
from fields_engine import FieldsEngine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from standin_service import serving, standin_index

import cfir_jax
from cfir_jax.api.client import ServiceError
from cfir_jax.core.query_rule import FilterError
from tests.helpers.tls_proxy import self_signed, tls_proxy

TAGS = ["a,b", "a", " x ", '"q"', "é, ü", "日本", "sport"]
DATES = ["2020-06-30T14:05:30Z", "2020-06-30T23:59:00Z", "2020-07-01T00:00:00Z", "2021-01-01T00:00:00Z"]
N = 20


def _row(n: int) -> dict:
    row = {"tags": [TAGS[n % 7], TAGS[(2 * n + 3) % 7]] if n % 5 else None, "date": DATES[n % 4] if n % 6 else None}
    if n % 3:
        row["editorial"] = bool(n % 2)
    return row


ROWS = [_row(n) for n in range(N)]
KINDS = {"tags": "list", "date": "date", "editorial": "boolean"}
SECONDS = [int(dt.datetime.fromisoformat(d).timestamp()) for d in DATES]
SPANS = {"2020": (2020, 2021), "2020-06": ("2020-06", "2020-07"), "2020-06-30": ("2020-06-30", "2020-07-01"),
         "2020-06-30T14:05": ("2020-06-30T14:05", "2020-06-30T14:06"), 2020: (2020, 2021)}


def _at(text) -> int:
    text = str(text)
    text = {4: text + "-01-01", 7: text + "-01"}.get(len(text), text)
    return int(dt.datetime.fromisoformat(text).replace(tzinfo=dt.UTC).timestamp())


def _passes(row: dict, field: str, op: str, value) -> bool:
    if row.get(field) is None:  # an image without the field fails every condition on it, != included
        return False
    values = value if isinstance(value, list) else [value]
    if field == "tags":
        holds = any(v in row["tags"] for v in values)
        return not holds if op == "!=" else holds
    if field == "editorial":
        holds = row["editorial"] in [v if isinstance(v, bool) else v.lower() == "true" for v in values]
        return not holds if op == "!=" else holds
    at = int(dt.datetime.fromisoformat(row["date"]).timestamp())
    spans = [(_at(SPANS[v][0]), _at(SPANS[v][1])) for v in values]
    lo, hi = spans[0]
    return {"=": any(a <= at < b for a, b in spans), "in": any(a <= at < b for a, b in spans),
            "!=": not lo <= at < hi, "<": at < lo, "<=": at < hi, ">": at >= hi, ">=": at >= lo}[op]


BOOL = st.sampled_from([True, False, "true", "FALSE"])
CONDITION = st.one_of(
    st.tuples(st.just("tags"), st.sampled_from(["=", "!="]), st.sampled_from(TAGS)),
    st.tuples(st.just("tags"), st.just("in"), st.lists(st.sampled_from(TAGS), min_size=1, max_size=3)),
    st.tuples(st.just("editorial"), st.sampled_from(["=", "!="]), BOOL),
    st.tuples(st.just("editorial"), st.just("in"), st.lists(BOOL, min_size=1, max_size=2)),
    st.tuples(st.just("date"), st.sampled_from(["=", "!=", "<", "<=", ">", ">="]), st.sampled_from(list(SPANS))),
)


def _line(field: str, op: str, value) -> str | None:
    """The condition as a line, where a line can say it (no comma, quote or space around a value)."""
    values = [json.dumps(v) if isinstance(v, bool) else str(v) for v in (value if isinstance(value, list) else [value])]
    if any("," in v or '"' in v or v != v.strip() for v in values):
        return None
    return f"{field} in {','.join(values)}" if op == "in" else f"{field}{op}{values[0]}"


def _http(url: str, where: list) -> list[str]:
    body = json.dumps({"text": "a text", "top_k": 50, "where": where}).encode()
    request = urllib.request.Request(url + "/v1/search", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=20) as answer:
        return [h["image_id"] for h in json.loads(answer.read())["hits"]]


@pytest.fixture(scope="module")
def doors(tmp_path_factory):
    """(the library's Index, the service's url, its client, its client through a TLS 1.3 proxy)."""
    cert, key = self_signed(tmp_path_factory.mktemp("tls"))
    with serving(retriever=FieldsEngine(ROWS, KINDS), max_top_k=50) as (url, _, _):
        with tls_proxy(url, cert, key) as secure:
            yield (standin_index(FieldsEngine(ROWS, KINDS), 50), url, cfir_jax.Client(url),
                   cfir_jax.Client(secure, deadline_s=20, ca=cert))


@settings(max_examples=50, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.lists(CONDITION, min_size=1, max_size=3))
def test_a_typed_filter_gives_the_same_ids_at_every_door(doors, where):
    index, url, client, secure = doors
    expected = [f"img-{n}" for n, row in enumerate(ROWS) if all(_passes(row, *c) for c in where)]
    assert index.search("a text", top_k=50, where=where).ids == expected, where
    assert client.search("a text", top_k=50, where=where).ids == expected, where
    assert secure.search("a text", top_k=50, where=where).ids == expected, where
    assert _http(url, [list(c) for c in where]) == expected, where
    lines = [_line(*c) for c in where]
    if None not in lines:
        assert index.search("a text", top_k=50, where=lines).ids == expected, lines
        assert _http(url, lines) == expected, lines


@pytest.mark.parametrize("where, status", [
    (["tags<a"], 422), ([("editorial", "=", "maybe")], 422), ([("date", "<", "last week")], 422),
    (["colour=red"], 422), ([("tags", "in", ["a"] * 1_025)], 413), (["tags=a"] * 17, 413),
    ([("tags", "=", "x" * 16_385)], 413),
])
def test_a_typed_refusal_is_one_line_with_its_status_at_every_door(doors, where, status):
    index, _, client, secure = doors
    with pytest.raises(FilterError) as alone:
        index.search("a text", top_k=50, where=where)
    assert alone.value.status == status and "\n" not in str(alone.value)
    for door in (client, secure):
        with pytest.raises(ServiceError) as e:
            door.search("a text", top_k=50, where=where)
        assert (e.value.status, str(e.value)) == (status, str(alone.value))


@pytest.mark.parametrize("where", [("tags=a",), "tags=a", (("tags", "=", "a"),), [("tags", "in", ["a,b", "a"])]])
def test_a_query_made_by_hand_is_held_to_the_rule(doors, where):
    """`Index.search(Query(...))` with `where` as lines, a line or triples answers what its parsed conditions answer
    (before, an AttributeError or 'unhashable type': a traceback), and a fold that is no bool is refused in one
    line."""
    from cfir_jax.core.query_rule import Query, QueryRefused, conditions

    index = doors[0]
    assert index.search(Query(text="a text", top_k=50, where=where)).ids == \
        index.search(Query("a text", top_k=50, where=conditions(where))).ids
    with pytest.raises(QueryRefused, match="^fold: expected true or false, got str$"):
        index.search(Query(text="a text", top_k=50, fold="no"))


@pytest.mark.parametrize("where", [[("colour", "=", "a\nb")], [("tags", "<", "x\r\ny")], [("date\n", "=", "2020")],
                                   [("editorial", "in", ["yes\x00", "no"])]])
def test_a_refusal_naming_a_value_with_a_line_break_is_still_one_line_and_the_same_at_the_client(doors, where):
    """A triple's value is its own, line breaks and control characters included; the refusal that names it shows
    them escaped, so it stays one line at the library and the client reads the same line (before, the library's
    refusal held the line break and the client read its first half)."""
    index, _, client, _ = doors
    with pytest.raises(FilterError) as alone:
        index.search("a text", top_k=50, where=where)
    assert "\n" not in str(alone.value) and "\r" not in str(alone.value), str(alone.value)
    with pytest.raises(ServiceError) as e:
        client.search("a text", top_k=50, where=where)
    assert (e.value.status, str(e.value)) == (422, str(alone.value))
