"""The index in shards (`cfir_jax.serve.shard`) merged by the front (`cfir_jax.serve.merge`), in one process: with
exact SR the answers equal one Retriever's (ids, order, scores, which entities brought each hit, the union's size,
the note) with 1, 2 and 4 shards, for CFIR (unseen entities searched over every shard, the no-entity fallback over
every shard's rows), fused SR, entity-text matches and a dense baseline, on a copy of the tiny index with rows
removed (removed rows never come back from any shard); and so does search by picture (an indexed picture's id: its
row searched on every shard and merged)."""

import copy
import shutil

import numpy as np
import pytest
from removals import commit_removal

from cfir_jax.core.errors import CfirError
from cfir_jax.retrieve.image_query import UnknownPicture, search_image
from cfir_jax.retrieve.pipeline import DocumentInput, Retriever
from cfir_jax.serve.merge import ClusterRetriever, LocalShards, merge_ranked
from cfir_jax.serve.shard import ShardIndex, shard_bounds
from cfir_jax.stores.image_cache import ImageCache

EXACT = dict(sr="exact", sr_backend="cpu", top_k=30)
CASES = {
    "cfir": ("cfir", EXACT),
    "cfir_fused_text_match": ("cfir", dict(EXACT, fusion=dict(w_img=1.0, w_txt=0.75, compare_w_txt=0),
                                           entity_text_match=True)),
    "dense_summary": ("dense_summary", EXACT),
}
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


def _same(one, many) -> None:
    assert [(h.rank, h.image_id, h.row, h.entities) for h in one.hits] == \
        [(h.rank, h.image_id, h.row, h.entities) for h in many.hits]
    assert [h.score for h in one.hits] == [h.score for h in many.hits]  # bit-equal, not close
    assert (one.entities, one.unknown_entities, one.summary, one.note, one.num_candidates) == \
        (many.entities, many.unknown_entities, many.summary, many.note, many.num_candidates)
    assert set(one.times_ms) == set(many.times_ms)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_answers_with_1_2_and_4_shards_equal_one_process(removed_copy, config, name):
    w, docs, removed = removed_copy
    method, settings = CASES[name]
    cfg = _config(config, **settings)
    expected = Retriever(cfg, w, method).retrieve_many(docs)
    assert any(r.note for r in expected) == (method == "cfir")  # the fallback is among the cases compared
    if name == "cfir":
        assert expected[-1].unknown_entities and expected[-1].hits[0].entities  # searched lists brought hits
    for shards in (1, 2, 4):
        parts = [ShardIndex(cfg, str(w), s, shards, [method]) for s in range(shards)]
        got = ClusterRetriever(cfg, str(w), method, LocalShards(parts)).retrieve_many(docs)
        for one, many in zip(expected, got):
            _same(one, many)
            assert not removed & {h.row for h in many.hits}


def test_shard_bounds_cover_every_row_once_and_refuse_more_shards_than_rows():
    bounds = shard_bounds(10, 4)
    assert bounds == [(0, 2), (2, 5), (5, 7), (7, 10)]
    assert shard_bounds(7, 1) == [(0, 7)]
    with pytest.raises(CfirError, match="exceeds the 3 rows"):
        shard_bounds(3, 4)


def test_merge_orders_by_score_then_lower_row_and_drops_padding():
    order, rows = merge_ranked([np.array([0.9, 0.5, -np.inf], np.float32), np.array([0.9, 0.7], np.float32)],
                               [np.array([7, 3, -1]), np.array([2, 9])], 3)
    assert rows.tolist() == [2, 7, 9] and order.tolist() == [3, 0, 4]


def test_a_shard_refuses_a_version_it_does_not_hold(removed_copy, config):
    w, docs, _ = removed_copy
    cfg = _config(config, **EXACT)
    part = ShardIndex(cfg, str(w), 0, 2, ["cfir"])
    retriever = ClusterRetriever(cfg, str(w), "cfir", LocalShards([part]))
    retriever.version += 1  # a front that loaded another version than the shard holds
    with pytest.raises(CfirError, match="holds version"):
        retriever.retrieve_many(docs[:1])


@pytest.mark.slow
def test_a_picture_search_on_1_2_and_4_shards_equals_one_process(removed_copy, config):
    """Exact on every shard count, a dense method's shards included; with ScaNN asked for, the cluster answers
    exactly and its note says so."""
    w, _, removed = removed_copy
    ids = ImageCache.open(w / "image_cache").ids
    asked = [ids[r] for r in range(0, len(ids), max(1, len(ids) // 5)) if r not in removed][:4]
    one = Retriever(_config(config, **EXACT), w)  # the single process's exact picture search
    expected = [search_image(one, image_id=i, top_k=25) for i in asked]
    scann = " (index.entity_index.backend=scann: the cluster searches its shards exactly)"
    for shards, method, backend in ((1, "cfir", "exact"), (2, "dense_document", "exact"), (4, "cfir", "exact"),
                                    (2, "cfir", "scann")):
        cfg = _config(config, **EXACT)
        cfg.index.entity_index.backend = backend
        parts = [ShardIndex(cfg, str(w), s, shards, [method]) for s in range(shards)]
        front = ClusterRetriever(cfg, str(w), method, _Counted(parts))
        for image_id, want in zip(asked, expected):
            got = search_image(front, image_id=image_id, top_k=25)
            assert got.hits[0].image_id == image_id
            assert [(h.rank, h.image_id, h.row, h.score) for h in got.hits] == \
                [(h.rank, h.image_id, h.row, h.score) for h in want.hits]  # scores bit-equal
            assert got.num_candidates == want.num_candidates and not removed & {h.row for h in got.hits}
            assert got.note == want.note + (scann if backend == "scann" else "")
        assert front.client.asked == len(asked)  # every picture searched on the shards, none on the front
        with pytest.raises(UnknownPicture, match="was removed"):
            search_image(front, image_id=ids[min(removed)], top_k=3)


class _Counted(LocalShards):
    asked = 0

    def pictures(self, version, query, k):
        self.asked += 1
        return super().pictures(version, query, k)
