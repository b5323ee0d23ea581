"""One filter, one meaning at every door (issue 58): for random conditions whose values hold commas, spaces, quotes
and any Unicode, the library (`Index.search`, `search_many`), the client (`Client.search`, `search_many`: JSON
triples over HTTP) and the service's batching path (the micro-batcher, `Index.search_documents`) answer the same
ids: those of the images that pass, written out by hand. Before, the client wrote a triple as a line that the
service parsed again: `("license", "in", ["a,b", "c"])` became three values, `" x "` lost its spaces, `'"q"'` its
quotes."""

import pytest
from fields_engine import FieldsEngine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from standin_service import serving, standin_index

import cfir_jax

VOCAB = ["a,b", "a", "b", " x ", "x", '"q"', "q", "é, ü", "cc-by", "'s'", "a b", "日本"]
N = 24


def _row(n: int) -> dict:
    row = {}
    if n % 7:
        row["license"] = VOCAB[n % len(VOCAB)]
    if n % 5:
        row["source"] = VOCAB[(3 * n + 1) % len(VOCAB)]
    return row


ROWS = [_row(n) for n in range(N)]
VALUE = st.one_of(st.sampled_from(VOCAB), st.text(st.characters(blacklist_categories=("Cs",)), min_size=1,
                                                  max_size=6))
CONDITION = st.one_of(
    st.tuples(st.sampled_from(["license", "source"]), st.sampled_from(["=", "!="]), VALUE),
    st.tuples(st.sampled_from(["license", "source"]), st.just("in"), st.lists(VALUE, min_size=1, max_size=4)))


def _passes(row: dict, field: str, op: str, value) -> bool:
    if field not in row:  # an image without the field fails every condition on it, != included
        return False
    values = value if isinstance(value, list) else [value]
    return row[field] != values[0] if op == "!=" else row[field] in values


@pytest.fixture(scope="module")
def doors():
    """(the library's Index, the client of a service over the same images)."""
    with serving(retriever=FieldsEngine(ROWS), max_top_k=50) as (url, _, _):
        yield standin_index(FieldsEngine(ROWS), 50), cfir_jax.Client(url)


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.lists(CONDITION, min_size=1, max_size=2))
def test_the_library_the_client_and_the_service_give_the_same_ids(doors, where):
    index, client = doors
    expected = [f"img-{n}" for n, row in enumerate(ROWS) if all(_passes(row, *c) for c in where)]
    library = index.search("a text", top_k=50, where=where)
    assert library.ids == expected, where
    assert client.search("a text", top_k=50, where=where).ids == expected, where
    many = client.search_many(["one", "two"], top_k=50, where=where)  # the batch route: one filter for both
    assert [r.ids for r in many] == [expected, expected] == [r.ids for r in index.search_many(["one", "two"],
                                                                                                top_k=50, where=where)]


def test_a_line_means_at_the_client_what_it_means_in_the_library(doors):
    index, client = doors
    for where in (["license in a, b"], ["source='a b'"], ["license!=x"]):
        assert client.search("t", top_k=50, where=where).ids == index.search("t", top_k=50, where=where).ids
    assert index.search("t", top_k=50, where=["license in a, b"]).ids == \
        index.search("t", top_k=50, where=[("license", "in", ["a", "b"])]).ids
