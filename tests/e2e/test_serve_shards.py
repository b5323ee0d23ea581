"""The index in shards (`cfir_jax.cluster.shard`) scoring a front's Retriever (`cfir_jax.cluster.scoring.ShardedSR`),
in one process: with exact SR the answers equal one Retriever's (ids, order, scores bit for bit, which entities
brought each hit in, the union's size, the note) with 1, 2 and 4 shards, for every method of `retrieve.py --method`
(CFIR with unseen entities searched over every shard and the no-entity fallback over every shard's rows, fused SR
with entity-text matches, the dense and entity-only baselines, BM25 and CFIR with BM25), on a copy of the tiny index
with rows removed (removed rows never come back from any shard); and so does search by image. A shard answers at
exactly the version it holds; the front's Retriever over the shards builds no copy of the cache."""

import copy
import shutil

import numpy as np
import pytest
from removals import commit_removal

from cfir_jax.cluster.reload import VersionGone
from cfir_jax.cluster.scoring import ShardedSR, merge_ranked, split_union
from cfir_jax.cluster.shard import LocalShards, ShardClient, ShardSearch, shard_bounds
from cfir_jax.core.errors import CfirError
from cfir_jax.retrieve.image_query import UnknownImage, search_image
from cfir_jax.retrieve.methods import METHODS
from cfir_jax.retrieve.pipeline import DocumentInput, Retriever
from cfir_jax.retrieve.scoring import Scoring
from cfir_jax.retrieve.sr import SRFrontEnd
from cfir_jax.stores.image_cache import ImageCache

EXACT = dict(sr="exact", sr_backend="cpu", top_k=30)
FUSED = dict(EXACT, fusion=dict(w_img=1.0, w_txt=0.75, compare_w_txt=0), entity_text_match=True)
EXTRA = [DocumentInput("Nothing named here at all, only words.", "no-entity"),
         DocumentInput("Quentin Zabrowski of the Xylo Harbour Society met Priya Okonkwo in Vennmark.", "unseen")]


def _config(config, **retrieval):
    cfg = copy.deepcopy(config)
    cfg.retrieval.update(**retrieval)
    return cfg


@pytest.fixture(scope="module")
def removed_copy(workdir, config, tmp_path_factory):
    """A copy of the tiny index with the first documents' best images removed (what index.py --remove records)."""
    w = tmp_path_factory.mktemp("shards") / "W"
    shutil.copytree(workdir, w, ignore=shutil.ignore_patterns("train", "pretrain"))
    single = Retriever(_config(config, **EXACT), w)
    docs = single.corpus_documents("test")[:6] + EXTRA
    rows = sorted({h.row for r in single.retrieve_many(docs) for h in r.hits[:2]})
    ids = ImageCache.open(w / "image_cache").ids
    commit_removal(w, [ids[r] for r in rows])
    return w, docs, set(rows)


def _front(cfg, w, method, shards: int) -> Retriever:
    parts = LocalShards([ShardSearch(cfg, str(w), s, shards) for s in range(shards)])
    return Retriever(cfg, str(w), method, scoring=ShardedSR.factory(parts, parts.parts[0].vid))


def _same(one, many) -> None:
    assert [(h.rank, h.image_id, h.row, h.entities) for h in one.hits] == \
        [(h.rank, h.image_id, h.row, h.entities) for h in many.hits]
    assert [h.score for h in one.hits] == [h.score for h in many.hits]  # bit-equal, not close
    assert (one.entities, one.unknown_entities, one.summary, one.note, one.num_candidates) == \
        (many.entities, many.unknown_entities, many.summary, many.note, many.num_candidates)
    assert set(one.times_ms) == set(many.times_ms)


def test_every_method_is_served_on_the_shards_and_equals_one_process(removed_copy, config):
    """2 shards, each method once (the fused settings where fusion applies); then 1 and 4 shards for CFIR."""
    w, docs, removed = removed_copy
    for method in METHODS:
        cfg = _config(config, **(FUSED if METHODS[method].cfir else EXACT))
        cfg.retrieval.lexical.alpha = 0.5  # the convex fusions' weights, given (no fitted store in this world)
        cfg.retrieval.fusion.alpha = 0.5
        expected = Retriever(cfg, w, method).retrieve_many(docs)
        for shards in (1, 2, 4) if method == "cfir" else (2,):
            front = _front(cfg, w, method, shards)
            assert isinstance(front.sr, Scoring) and front.sr.backend() == "shards"
            for one, many in zip(expected, front.retrieve_many(docs)):
                _same(one, many)
                assert not removed & {h.row for h in many.hits}
    assert any(r.note for r in Retriever(_config(config, **EXACT), w).retrieve_many(docs))  # the fallback ran
    unseen = Retriever(_config(config, **EXACT), w).retrieve(EXTRA[1])
    assert unseen.unknown_entities and unseen.hits[0].entities  # searched lists brought hits


def test_a_front_over_the_shards_holds_no_copy_of_the_cache(removed_copy, config, monkeypatch):
    """With SR on the device, the shards hold the device copies; the front's Retriever makes no SR front end at
    all (so no device copy and no compact copy), and answers as one process does on the device."""
    w, docs, _ = removed_copy
    cfg = _config(config, **dict(EXACT, sr_backend="device"))
    parts = LocalShards([ShardSearch(cfg, str(w), s, 2) for s in range(2)])
    made = []
    monkeypatch.setattr(SRFrontEnd, "prepare", lambda self: made.append(self))
    front = Retriever(cfg, str(w), "cfir", scoring=ShardedSR.factory(parts, parts.parts[0].vid))
    assert not made and not isinstance(front.sr, SRFrontEnd)
    monkeypatch.undo()
    expected = Retriever(cfg, w, "cfir").retrieve_many(docs)
    for one, many in zip(expected, front.retrieve_many(docs)):
        assert [h.image_id for h in one.hits] == [h.image_id for h in many.hits]
        assert [h.score for h in one.hits] == pytest.approx([h.score for h in many.hits], abs=1e-5)


def test_a_shard_on_the_device_compiles_every_shape_before_it_answers(removed_copy, config):
    """Its warm-up (what a replica runs before Ray sends it a request) compiles SR of every union bucket at every
    query batch up to serve.max_batch, and the search of its rows: a batch of any such shape compiles nothing."""
    w, _, _ = removed_copy
    cfg = _config(config, **dict(EXACT, sr_backend="device", sr_buckets=[8, 32, 128], sr_query_batch=4))
    part = ShardSearch(cfg, str(w), 1, 2)
    part.warm_up(max_batch=4)
    cache = part.sr[False].device_cache()
    warmed = cache.traces
    assert warmed >= 3 * 3  # 3 buckets x query batches 1, 2, 4
    rng = np.random.default_rng(0)
    for q in (1, 2, 3, 4):
        unions = [np.sort(rng.choice(np.arange(part.lo, part.hi), size, replace=False)).astype(np.int32)
                  for size in rng.integers(1, min(128, part.hi - part.lo), q)]
        part.score(False, rng.standard_normal((q, cache.dim)).astype(np.float32), unions)
        part.search(rng.standard_normal((q, cache.dim)).astype(np.float32), 10)
    assert cache.traces == warmed


def test_shard_bounds_cover_every_row_once_and_refuse_more_shards_than_rows():
    bounds = shard_bounds(10, 4)
    assert bounds == [(0, 2), (2, 5), (5, 7), (7, 10)]
    assert shard_bounds(7, 1) == [(0, 7)]
    with pytest.raises(CfirError, match="exceeds the 3 rows"):
        shard_bounds(3, 4)
    assert [p.tolist() for p in split_union(np.array([0, 1, 4, 5, 9]), bounds)] == [[0, 1], [4], [5], [9]]


def test_merge_orders_by_score_then_lower_row_and_drops_padding():
    scores, rows = merge_ranked([np.array([0.9, 0.5, -np.inf], np.float32), np.array([0.9, 0.7], np.float32)],
                                [np.array([7, 3, -1]), np.array([2, 9])], 3)
    assert rows.tolist() == [2, 7, 9] and scores.tolist() == pytest.approx([0.9, 0.9, 0.7])


def test_a_shard_answers_at_the_version_it_holds_or_not_at_all(removed_copy, config):
    w, docs, _ = removed_copy
    cfg = _config(config, **EXACT)
    part = ShardSearch(cfg, str(w), 0, 2)
    with pytest.raises(VersionGone, match="no longer in the workdir"):
        ShardSearch(cfg, str(w), 0, 2, vid="1:another")
    client = LocalShards([part, ShardSearch(cfg, str(w), 1, 2)])
    assert isinstance(client, ShardClient)
    front = Retriever(cfg, str(w), "cfir", scoring=ShardedSR.factory(client, "1:another"))  # a front of another one
    with pytest.raises(CfirError, match="answered at version"):
        front.retrieve_many(docs[:1])


@pytest.mark.slow
def test_an_image_search_on_1_2_and_4_shards_equals_one_process(removed_copy, config):
    """Exact on every shard count, a dense method's shards included, as one process searches by image."""
    w, _, removed = removed_copy
    ids = ImageCache.open(w / "image_cache").ids
    asked = [ids[r] for r in range(0, len(ids), max(1, len(ids) // 5)) if r not in removed][:4]
    cfg = _config(config, **EXACT)
    cfg.index.entity_index.backend = "exact"
    one = Retriever(cfg, w)  # the single process's exact image search
    expected = [search_image(one, image_id=i, top_k=25) for i in asked]
    for shards, method in ((1, "cfir"), (2, "dense_document"), (4, "cfir")):
        front = _front(cfg, w, method, shards)
        for image_id, want in zip(asked, expected):
            got = search_image(front, image_id=image_id, top_k=25)
            assert got.hits[0].image_id == image_id
            assert [(h.rank, h.image_id, h.row, h.score) for h in got.hits] == \
                [(h.rank, h.image_id, h.row, h.score) for h in want.hits]  # scores bit-equal
            assert got.num_candidates == want.num_candidates and not removed & {h.row for h in got.hits}
            assert got.note == want.note
        with pytest.raises(UnknownImage, match="was removed"):
            search_image(front, image_id=ids[min(removed)], top_k=3)
