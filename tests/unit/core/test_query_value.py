"""The one `Query` value and its typed conditions (cfir_jax/core/query_rule.py): a line parsed once, a triple taken
as it is (its values verbatim: commas, spaces, quotes, any Unicode), the JSON triple a condition crosses the wire
as read back as the same condition, and a filter past the config's limits refused in one line (413) before it is
parsed."""

import dataclasses
import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cfir_jax.core.config_serve import serve_config
from cfir_jax.core.query_rule import Condition, FilterError, FilterLimits, Query, QueryRefused, conditions, parse

VALUES = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12)
TRIPLES = st.one_of(
    st.tuples(st.sampled_from(["license", "source", "n"]), st.sampled_from(["=", "!=", "<", ">="]), VALUES),
    st.tuples(st.sampled_from(["license", "source"]), st.just("in"), st.lists(VALUES, min_size=1, max_size=4)))


@settings(max_examples=200, deadline=None, database=None)
@given(triples=st.lists(TRIPLES, max_size=4))
def test_a_triple_is_taken_as_it_is_and_its_json_reads_back_the_same(triples):
    conds = conditions(triples)
    for (field, op, value), cond in zip(triples, conds):
        assert cond == Condition(field, op, tuple(value) if isinstance(value, list) else (value,))
    wire = json.loads(json.dumps([c.to_json() for c in conds]))  # what the client sends, as the service reads it
    assert conditions(wire) == conds


@pytest.mark.parametrize("triple, values", [
    (("license", "in", ["a,b", "c"]), ("a,b", "c")),
    (("source", "=", " x "), (" x ",)),
    (("source", "=", '"q"'), ('"q"',)),
    (("source", "in", ["é, ü", "  "]), ("é, ü", "  ")),
])
def test_commas_spaces_and_quotes_of_a_triple_are_its_own(triple, values):
    assert parse(triple).values == values
    assert parse(parse(triple).to_json()).values == values


def test_a_line_is_parsed_once_and_a_condition_passes_as_itself():
    cond = parse("license in cc-by, 'cc 0'")
    assert cond == Condition("license", "in", ("cc-by", "cc 0"))
    assert conditions([cond, "n>=3"]) == (cond, Condition("n", ">=", ("3",)))
    assert conditions(None) == () == conditions([])


@pytest.mark.parametrize("where, says", [
    ([("a", "like", "b")], "unknown operator 'like'"), ([("a", "=", ["b", "c"])], "one value for ="),
    ([("a", "in", [])], "no value"), ([("a", "=", None)], "a value is a string, a number or a bool"),
    ([(1, "=", "b")], "a triple"), ("x", "expected FIELD OP VALUE"), ([("a", "=", "\ud800")], "not valid Unicode"),
])
def test_a_malformed_condition_is_one_line(where, says):
    with pytest.raises(FilterError, match=says) as e:
        conditions(where)
    assert "\n" not in str(e.value) and e.value.status == 422


def test_a_filter_past_its_limits_is_413_before_it_is_parsed():
    limits = FilterLimits.of(serve_config())
    huge = ["license", "in", [f"v{n}" for n in range(10_000)]]
    t0 = time.perf_counter()
    for where, says in [([huge], "10,000 values, over serve.max_filter_values=1,024"),
                        (["a=1"] * 17, "17 conditions, over serve.max_filter_conditions=16"),
                        (["license in " + ",".join(huge[2])], "characters, over serve.max_filter_bytes=16,384"),
                        ([["s", "in", ["x" * 1000] * 17]], "bytes of fields and values, over serve.max_filter_bytes")]:
        with pytest.raises(FilterError, match=says) as e:
            limits.read(where)
        assert e.value.status == 413
    assert time.perf_counter() - t0 < 1.0
    assert limits.read(["a=1", ("b", "in", ["x,y"])]) == (Condition("a", "=", ("1",)), Condition("b", "in", ("x,y",)))


def test_a_query_is_made_once_from_a_doors_values():
    q = Query("some text", top_k=5, lang="fr-CA", where=["n>=3", ("s", "in", ["a,b"])], id="q1")
    assert (q.text, q.top_k, q.lang, q.id, q.fold) == ("some text", 5, "fr", "q1", True)
    assert q.where_json() == [["n", ">=", "3"], ["s", "in", ["a,b"]]]
    with pytest.raises(QueryRefused, match="give one of"):
        Query("text", image_id="img-1")
    with pytest.raises(QueryRefused, match="top_k=True: an integer"):
        Query("text", top_k=True)
    with pytest.raises(AttributeError):
        q.top_k = 3  # frozen: carried unchanged to the core
    assert dataclasses.replace(q, top_k=3).where == q.where  # checked again when changed, its checked forms kept
    with pytest.raises(QueryRefused, match="an integer"):
        dataclasses.replace(q, top_k="3")  # no Query escapes the rule, made by hand or changed


@pytest.mark.parametrize("where", [
    [("n", "=", 10**5000)], [("n", "in", [1, 10**5000])], [(10**5000, "=", "b")], [("n", "=", [10**5000] * 2)],
])
def test_a_number_too_long_to_write_is_one_line_not_a_traceback(where):
    """Python writes no int of over 4,300 digits (`str()` raises ValueError): a triple holding one is refused in one
    line naming its size, at parsing and past the limits (before, a ValueError: a traceback at the library and the
    client)."""
    for read in (conditions, FilterLimits.of(serve_config()).read,
                 lambda w: FilterLimits(16, 1, 16_384).read(w)):  # past max_filter_values: its refusal names it too
        with pytest.raises(FilterError) as e:
            read(where)
        assert "\n" not in str(e.value) and len(str(e.value)) < 300, str(e.value)
