"""Facets (issue 61 item 4; docs/filters.md): the values of a field counted over the images a query ranked, the 20
largest by count (ties by value), with `ranked`. A string counts its value, a list each value it holds once per
image, a boolean "true"/"false", a date its month in the store's zone; a number field and an unknown field are one
line (422 at the service). The library, the service (in-process) and the client give equal facets; a filter's
facets count only passing images; near-duplicates folded count once; an answer without facets is unchanged."""

import asyncio
import collections
import json
import re
import time
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from fields_engine import HOLD, Fields, FieldsEngine, together_and_alone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from standin_service import serving, standin_index

import cfir_jax
from cfir_jax.core.query_rule import Condition, Query, QueryRefused
from cfir_jax.retrieve import facets as facets_lib
from cfir_jax.retrieve.pipeline import DocumentInput, RankedImage, Retrieval
from cfir_jax.retrieve.results import Result
from cfir_jax.serve import batcher as batcher_lib
from cfir_jax.serve.metrics import Metrics

SOURCES = ("reuters", "ap", "afp")
ROWS = [{"source": SOURCES[n % 3], "tags": [["news", "sport", "news"], ["sport"], [], None][n % 4],
         "featured": n % 5 == 0, "date": f"2020-{1 + n % 3:02d}-15", "n": n,
         **({"credit": "desk"} if n % 2 else {})} for n in range(30)]
KINDS = {"source": "string", "tags": "list", "featured": "boolean", "date": "date", "n": "number",
         "credit": "string"}


def _counted(rows, names, ranked=None, zone="UTC"):
    fields = Fields(rows, KINDS)
    for column in fields.columns.values():
        column.zone = zone
    return facets_lib.Facets(fields).count(np.arange(len(rows)) if ranked is None else np.asarray(ranked), names)


def test_each_kind_counts_as_a_search_page_shows_it():
    got = _counted(ROWS, ["source", "tags", "featured", "date", "credit"])
    assert got["source"] == {"afp": 10, "ap": 10, "reuters": 10}  # ties by value
    assert got["tags"] == {"sport": 16, "news": 8}  # "news" twice in one list counts once; [] and null count none
    assert got["featured"] == {"false": 24, "true": 6}
    assert got["date"] == {"2020-01": 10, "2020-02": 10, "2020-03": 10}
    assert got["credit"] == {"desk": 15}  # the images without the field are not counted
    assert sum(got["source"].values()) == len(ROWS)


def test_only_the_20_largest_values_by_count_ties_by_value():
    rows = [{"source": f"s{n:02d}"} for n in range(30)] + [{"source": "s29"}] * 3 + [{"source": "s05"}]
    got = _counted(rows, ["source"])["source"]
    assert list(got.items())[:2] == [("s29", 4), ("s05", 2)]
    assert len(got) == 20 and list(got)[2:] == [f"s{n:02d}" for n in range(30) if n not in (5, 29)][:18]


def test_a_date_is_counted_by_its_month_in_the_store_s_zone():
    rows = [{"date": "2020-06-30T21:00-04:00"}, {"date": "2020-07-01T03:00Z"}, {"date": "2020-06-01T02:00Z"}]
    assert _counted(rows, ["date"])["date"] == {"2020-07": 2, "2020-06": 1}
    assert _counted(rows, ["date"], zone="America/New_York")["date"] == {"2020-06": 2, "2020-05": 1}


def test_a_number_or_an_unknown_field_is_one_line():
    with pytest.raises(facets_lib.FacetError, match=r"^facets: n is a number field, which is not counted"):
        _counted(ROWS, ["n"])
    with pytest.raises(facets_lib.FacetError, match=r"^facets: unknown field 'colour' \(the images' fields: "
                                                    r"credit, date, featured, n, source, tags\)$"):
        _counted(ROWS, ["colour"])


def test_folded_near_duplicates_count_once_as_the_one_shown():
    group = np.array([0, 0, -1, 1, 1, -1])
    hits = [RankedImage(k + 1, f"img-{r}", 1.0, r) for k, r in enumerate([1, 3])]
    retrieval = Retrieval(hits, [], [], "", ranked_rows=np.array([0, 1, 2, 3, 4, 5]))
    rows = facets_lib.ranked_rows(retrieval, group)
    assert rows.tolist() == [1, 3, 2, 5]  # each group as its best-ranked (shown) row, then the rest of the union
    assert facets_lib.ranked_rows(retrieval, None).tolist() == [1, 3, 0, 2, 4, 5]


@settings(max_examples=200, deadline=None, database=None)
@given(union=st.lists(st.integers(0, 60), unique=True, max_size=40), ordered=st.booleans(),
       hits=st.lists(st.integers(0, 60), unique=True, max_size=8))
def test_the_rows_ranked_are_the_hits_then_the_rest_of_the_union_in_its_order(union, ordered, hits):
    """Whether the union is ascending (ER's, BM25's: the hits are found by binary search) or not (a table lookup), and
    whether each hit is in it or not."""
    union = sorted(union) if ordered else union
    retrieval = Retrieval([RankedImage(k + 1, f"img-{r}", 1.0, r) for k, r in enumerate(hits)], [], [], "",
                          ranked_rows=np.array(union, np.int64))
    assert facets_lib.ranked_rows(retrieval, None).tolist() == (hits + [r for r in union if r not in hits]
                                                                 if hits else union)


@settings(max_examples=60, deadline=None, database=None)
@given(values=st.lists(st.one_of(st.none(), st.sampled_from([f"s{i}" for i in range(300)])), min_size=1,
                       max_size=40), data=st.data())
def test_a_string_fields_counts_equal_a_plain_count(values, data):
    """An image without the field counts nowhere (its code shifted to 0); past 255 distinct values the codes are wider
    than a byte."""
    asked = data.draw(st.lists(st.integers(0, len(values) - 1), unique=True))
    counted = facets_lib.Facets(Fields([{"source": v} for v in values], {"source": "string"})).count(
        np.asarray(asked, np.int64), ["source"])["source"]
    plain = collections.Counter(values[r] for r in asked if values[r] is not None)
    assert counted == dict(sorted(plain.items(), key=lambda kv: (-kv[1], kv[0]))[:facets_lib.MAX_VALUES])


@pytest.fixture(scope="module")
def served():
    engine = FieldsEngine(ROWS, KINDS, max_top_k=50)
    with serving(retriever=engine, max_top_k=50) as (url, _, _):
        yield standin_index(engine, 50), cfir_jax.Client(url), url


def test_the_library_the_service_and_the_client_give_equal_facets(served):
    index, client, url = served
    got = index.search("text", top_k=3, facets=["source", "tags", "date"])
    assert got.ranked == len(ROWS) and len(got.hits) == 3  # over every image ranked, not the three shown
    assert got.facets["source"] == {"afp": 10, "ap": 10, "reuters": 10}
    assert sum(got.facets["source"].values()) == got.ranked
    assert client.search(Query("text", top_k=3, facets=["source", "tags", "date"])) == got
    assert (got.facets, got.ranked) == (Result.from_json(got.to_json()).facets, got.to_json()["ranked"])
    assert got.to_json()["facets"]["tags"] == {"sport": 16, "news": 8}
    many = index.search_many(["a", "b"], top_k=2, facets=["featured"])  # the client's batch: a Query each, or HTTP
    assert [r.facets for r in many] == [{"featured": {"false": 24, "true": 6}}] * 2


def test_facets_under_a_filter_count_only_the_passing_images(served):
    index, client, _ = served
    got = index.search("text", top_k=5, where=["source=ap"], facets=["source", "featured"])
    assert got.facets["source"] == {"ap": 10} and got.ranked == 10 == sum(got.facets["featured"].values())
    assert client.search(Query("text", top_k=5, where=["source=ap"], facets=["source", "featured"])) == got


def test_an_answer_without_facets_is_unchanged(served):
    index, client, _ = served
    plain = index.search("text", top_k=3)
    assert plain.facets is None and plain.ranked is None
    assert "facets" not in plain.to_json() and "ranked" not in plain.to_json()
    assert list(plain.to_json()) == ["id", "lang", "entities", "unknown_entities", "num_unknown_entities", "summary",
                                     "note", "num_candidates", "times_ms", "hits"]


@pytest.mark.parametrize("names, says", [
    (["colour"], "facets: unknown field 'colour'"),
    (["n"], "facets: n is a number field"),
    (["source", ""], "facets: ['source', ''] holds an empty or invalid field name"),
])
def test_a_bad_facet_field_is_one_line_422(served, names, says):
    index, client, url = served
    with pytest.raises(QueryRefused, match=f"^{re.escape(says)}"):
        index.search("text", top_k=3, facets=names)
    answer = httpx.post(f"{url}/v1/search", json={"text": "text", "top_k": 3, "facets": names})
    assert answer.status_code == 422 and answer.json()["error"].startswith(says), answer.text
    batch = httpx.post(f"{url}/v1/search/batch", json={"documents": [{"id": "a", "text": "t"}], "facets": names})
    assert batch.status_code == 422 and batch.json()["error"].startswith(says), batch.text


def test_a_batch_of_a_facet_request_a_bad_facet_and_a_plain_one_answers_each_as_alone():
    engine = FieldsEngine(ROWS, KINDS, 10)
    loaded = SimpleNamespace(index=standin_index(engine, 10), version=3, entity_pool=None)
    mb = batcher_lib.MicroBatcher(lambda: loaded, 64, 0.0, 256, Metrics())
    asked = {"facets": ("source", "tags"), "bad": ("colour",), "plain": (), "filtered": ("tags",)}

    def job(loop, name, n):
        where = (Condition("source", "=", ("ap",)),) if name == "filtered" else ()
        doc = DocumentInput(HOLD if name == "hold" else f"text {name}", name, where=where,
                            facets=asked.get(name, ()))
        return batcher_lib.Job([doc], "cfir", 5, time.monotonic() + 30, loop.create_future(), loop)

    async def outcome(j):
        try:
            return "ok", [{k: v for k, v in json.loads(a).items() if k != "times_ms"} for a in await j.future]
        except Exception as e:  # noqa: BLE001 - the outcome compared: its kind and its line
            return type(e).__name__, str(e)

    try:
        together, alone = asyncio.run(together_and_alone(mb, engine, job, list(asked), outcome))
    finally:
        mb.stop(5)
    assert together == alone
    kinds = dict(zip(asked, together))
    assert kinds["bad"][0] == "FacetError" and kinds["bad"][1].startswith("facets: unknown field 'colour'")
    assert kinds["facets"][1][0]["facets"]["source"] == {"afp": 10, "ap": 10, "reuters": 10}
    assert kinds["filtered"][1][0]["facets"] == {"tags": {"sport": 6, "news": 3}} and \
        kinds["filtered"][1][0]["ranked"] == 10
    assert "facets" not in kinds["plain"][1][0]


def test_the_ray_front_answers_facets_and_refuses_a_bad_field_as_the_service_does():
    """The Ray engine's front (`cluster.front.FrontService`, which the gateway calls through `cluster.deployments`)
    carries a document's facets to the same Index: counts with 200, an unknown field 422 beside them."""
    from standin_service import StandInHolder

    from cfir_jax.cluster.deployments import _status
    from cfir_jax.cluster.front import FrontService

    engine = FieldsEngine(ROWS, KINDS, 10)
    holder = StandInHolder(engine, 10)
    holder.client, holder.target = None, SimpleNamespace(generation=1)
    follower = SimpleNamespace(period_s=3600.0, poll=lambda: None, stuck=lambda: "", last_error="")
    front = FrontService(holder, holder.current.index.config.serve, None, follower)

    async def run():
        return [await _status(front.answer([DocumentInput("t", f"q{n}", facets=names)], "cfir", 5))
                for n, names in enumerate([("source",), ("colour",), ()])]

    try:
        answers = asyncio.run(run())
    finally:
        asyncio.run(front.shutdown())
    assert [status for status, _, _ in answers] == [200, 422, 200]
    assert json.loads(answers[0][1][0])["facets"] == {"source": {"afp": 10, "ap": 10, "reuters": 10}}
    assert answers[1][1].startswith("facets: unknown field 'colour'") and "facets" not in json.loads(answers[2][1][0])


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lists=st.lists(st.one_of(st.none(), st.lists(st.sampled_from([f"v{i}" for i in range(300)]), max_size=12)),
                      min_size=1, max_size=40), data=st.data(), padded=st.booleans())
def test_a_list_fields_counts_equal_a_plain_count_by_either_path(monkeypatch, lists, data, padded):
    """Each image counts each value it holds once, whether the field's rows are kept as a padded table (few values
    a row) or gathered ragged (TABLE_PADDING 0: never a table), over any rows asked, in any order; past 127
    distinct values the codes are wider than a byte."""
    monkeypatch.setattr(facets_lib, "TABLE_PADDING", 4 if padded else 0)
    rows = [{"tags": v} for v in lists]
    asked = data.draw(st.lists(st.integers(0, len(rows) - 1), unique=True))
    counted = facets_lib.Facets(Fields(rows, {"tags": "list"})).count(np.asarray(asked, np.int64), ["tags"])["tags"]
    plain = collections.Counter(v for r in asked for v in set(lists[r] or ()))
    assert counted == dict(sorted(plain.items(), key=lambda kv: (-kv[1], kv[0]))[:facets_lib.MAX_VALUES])
