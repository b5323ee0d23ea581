"""What the services ask of the library's `Index` (the one query core), over a stand-in engine: the served methods
opened together at one version, the default first; warmed by the service's hook, then the summary cache, then the
image tower; a batch of several requests' documents answered by one `retrieve_many`, each document with its own
top_k, language and filters; an image answered with the request's id."""

from types import SimpleNamespace

import pytest
from standin_service import settings

from cfir_jax.api.index import Index
from cfir_jax.core.errors import CfirError
from cfir_jax.core.query_rule import Condition, Query, QueryRefused
from cfir_jax.eval import runs
from cfir_jax.retrieve import image_query
from cfir_jax.retrieve.pipeline import DocumentInput, RankedImage, Retrieval
from cfir_jax.retrieve.results import Result


class Images:
    """A stand-in engine's image search with no tower (an imported cache): warming it has nothing to make."""

    has_tower = False

    def __init__(self, retriever):
        pass


class Engine:
    """A method's engine: five hits per document, each batch recorded with the documents as the engine saw them."""

    entities = None
    image_search = Images
    filters = SimpleNamespace(check=lambda where: None)  # every field known

    def __init__(self, method: str, summarises: bool = False):
        self.method, self.batches, self.summary_cache = method, [], None
        self.methods = SimpleNamespace(uses_summary=lambda: summarises)

    def retrieve_many(self, docs, progress=False):
        self.batches.append(list(docs))
        hits = [RankedImage(n + 1, f"img-{n}", 1.0 - n / 10, n) for n in range(5)]
        return [Retrieval(hits, [], [], "", times_ms={"er": 0.1}, lang=d.lang or "en") for d in docs]

    def describe_image(self, image_id):
        return f"caption of {image_id}", ""

    def cache_summaries(self, entries: int) -> None:
        self.summary_cache = entries


def _served(tmp_path, methods=("cfir", "bm25"), **engine):
    made = {}

    def make(config, workdir, method, **options):
        made[method] = Engine(method, **engine)
        return made[method]

    config = SimpleNamespace(retrieval=SimpleNamespace(top_k=5), serve=settings())
    index = Index(config, tmp_path, "dense_summary", make=make)
    return index, index.open_methods(list(methods)), made


def test_the_served_methods_open_together_and_the_first_is_the_default(tmp_path):
    (tmp_path / "index.json").write_text('{"version": 7}')
    index, version, made = _served(tmp_path)
    assert version == 7 and index.methods == ("cfir", "bm25") and index.method == "cfir"
    assert index._retriever() is made["cfir"] and index._retriever("bm25") is made["bm25"]


def test_warm_up_runs_the_hook_per_method_then_keeps_summaries(tmp_path):
    index, _, made = _served(tmp_path, summarises=True)
    warmed = []
    index.warm_up(warmed.append, summary_cache=32)
    assert warmed == ["cfir", "bm25"]
    assert made["cfir"].summary_cache == made["bm25"].summary_cache == 32
    assert isinstance(image_query.prepare(made["cfir"]), Images)  # prepared when opened, warmed (no tower)


def test_a_batch_of_requests_is_one_retrieval_with_each_documents_top_k_language_and_filters(tmp_path):
    index, _, made = _served(tmp_path)
    docs = [DocumentInput("first text", "a", lang="de", where=(Condition("license", "=", ("cc0",)),)),
            DocumentInput("second text", "b"),
            DocumentInput("third text", "c", where=(Condition("date", "<=", ("2020",)),))]
    results = index.search_documents(docs, [1, 5, 3], "bm25")
    assert made["cfir"].batches == [] and made["bm25"].batches == [docs]  # one batch, the documents untouched
    assert [(r.id, len(r.hits), r.lang) for r in results] == [("a", 1, "de"), ("b", 5, "en"), ("c", 3, "en")]
    assert results[0].hits[0].caption == "caption of img-0"
    assert [len(r.hits) for r in index.search_documents(docs, 2)] == [2, 2, 2]


def test_a_batch_refuses_a_top_k_past_the_index_and_a_count_that_does_not_match(tmp_path):
    index, _, _ = _served(tmp_path)
    docs = [DocumentInput("text", "a"), DocumentInput("text", "b")]
    with pytest.raises(QueryRefused, match=r"top_k=6 out of range: 1 \.\. 5"):
        index.search_documents(docs, [1, 6])
    with pytest.raises(CfirError, match="^1 top_k for 2 documents$"):
        index.search_documents(docs, [1])


def test_an_image_is_answered_with_the_requests_id_by_the_default_method(tmp_path, monkeypatch):
    index, _, made = _served(tmp_path)
    asked = {}

    def search_image(retriever, **query):
        asked.update(query, retriever=retriever)
        return Retrieval([RankedImage(1, "img-3", 0.5, 3)], [], [], "")

    monkeypatch.setattr(image_query, "search_image", search_image)
    query = Query(image_id="img-3", top_k=2, id="image-7", where=[("license", "=", "cc0")])
    index.check(query)
    result = index.search_image(query, 12.5)  # a service's image search, with its deadline
    assert (result.id, [h.id for h in result.hits]) == ("image-7", ["img-3"])
    assert asked["retriever"] is made["cfir"] and asked["deadline"] == 12.5 and asked["top_k"] == 2
    assert index.search(image=b"\x89PNG", top_k=1).id == "query"  # no id given: the door's default



def test_evaluation_s_filter_is_held_to_its_limits_and_checked_before_it_runs(tmp_path):
    """`Index.retrieve(where=...)` (`retrieve.py --evaluate --where`) checks the filter it was given, as every other
    search: past serve.max_filter_conditions it is 413 before any retrieval, and the engine's check sees the
    conditions (before, the first document's own, empty, conditions were checked instead)."""
    index, _, made = _served(tmp_path)
    docs = [DocumentInput("text", "a"), DocumentInput("text", "b")]
    with pytest.raises(QueryRefused, match=r"^where: 17 conditions, over serve.max_filter_conditions=16$") as e:
        index.retrieve(docs, where=["n>1"] * 17)
    assert e.value.status == 413 and made["cfir"].batches == []
    checked = []
    made["cfir"].filters = SimpleNamespace(check=checked.append)
    index.retrieve(docs, where=["license=cc0"])
    assert checked == [(Condition("license", "=", ("cc0",)),)]
    assert [d.where for d in made["cfir"].batches[-1]] == [(Condition("license", "=", ("cc0",)),)] * 2


def test_evaluation_reads_the_public_result_with_every_hit_and_its_rows(tmp_path):
    """One result shape crosses the door: `Index.retrieve` (evaluation's, the fits', a warm-up's) answers with
    `Result`s, every hit the pipeline ranked, no caption read, the hits' cache rows a field; a run file is made of
    them (`eval.runs.run_of`) with no second list of ids. Before, it handed out the pipeline's `Retrieval`s."""
    index, _, made = _served(tmp_path)
    got = index.retrieve([DocumentInput("text", "a"), DocumentInput("text", "b")])
    assert [type(r) for r in got] == [Result, Result] and [r.id for r in got] == ["a", "b"]
    assert got[0].ids == [f"img-{n}" for n in range(5)] and got[0].rows == (0, 1, 2, 3, 4)
    assert {h.caption for r in got for h in r.hits} == {""}  # measured, not shown: no caption read
    assert runs.run_of(got)["b"] == [(f"img-{n}", 1.0 - n / 10) for n in range(5)]
