"""Removed images (index.py --remove) are never returned: by any method, any SR backend, the unseen-entity search,
the no-entity fallback or the third stage; what is left ranks as before, and a whole-cache search still fills k.

The tiny index is copied, retrieved once by every case with top_k = every image (the full ranking), and the images
the cases rank first for the first test documents (the planted answers) are written to the copy's
image_cache/removed.txt, as a removal records them. Then every case runs again at top_k = 30."""

import copy
import shutil

import numpy as np
import pytest
from flax import nnx
from removals import commit_removal

from cfir_jax.retrieve.pipeline import DocumentInput, Retriever
from cfir_jax.search.topk import exact_topk
from cfir_jax.stores.image_cache import ImageCache
from cfir_jax.stores.integrity import verify_store

TOP_K = 30
EXACT = dict(sr="exact", sr_backend="cpu")
IGNORE = dict(EXACT, unknown_entities="ignore")  # no list is refilled: the union is the old one less the removed
# name: (method, retrieval settings, whether the ranking is the old one with the removed rows deleted)
CASES = {
    "cfir": ("cfir", IGNORE, True),
    "cfir_device": ("cfir", dict(IGNORE, sr_backend="device"), True),
    "cfir_fused": ("cfir", dict(IGNORE, fusion=dict(w_img=1.0, w_txt=0.75, compare_w_txt=0)), True),
    "cfir_text_match": ("cfir", dict(IGNORE, entity_text_match=True), True),
    "dense_document": ("dense_document", EXACT, True),
    "dense_summary": ("dense_summary", dict(EXACT, sr_backend="device"), True),
    "entity_only": ("entity_only", IGNORE, True),
    "cfir_searched": ("cfir", EXACT, False),  # unseen entities searched: their lists refill to K live rows
    "cfir_fast": ("cfir", dict(sr="fast", sr_backend="cpu"), False),
    "entity_only_searched": ("entity_only", EXACT, False),
}
NO_ENTITY = DocumentInput("the cat sat on the mat and then it slept on the warm rug.", "no-entity")


def _config(config, top_k, **retrieval):
    cfg = copy.deepcopy(config)
    cfg.retrieval.update(top_k=top_k, **retrieval)
    return cfg


@pytest.fixture(scope="module")
def removal(workdir, config, tmp_path_factory):
    """(copy with removals, test documents, every case's full ranking before, removed rows, the cache's rows N)."""
    w = tmp_path_factory.mktemp("removed") / "W"
    shutil.copytree(workdir, w)
    n = ImageCache.open(w / "image_cache").num_images
    docs = Retriever(config, w).corpus_documents("test") + [NO_ENTITY]
    before = {name: Retriever(_config(config, n, **settings), w, method).retrieve_many(docs)
              for name, (method, settings, _) in CASES.items()}
    planted = {h.row for results in before.values() for res in results[:6] for h in res.hits[:2]}
    planted |= {before["cfir"][-1].hits[0].row, before["dense_summary"][-1].hits[0].row}  # the fallback's best
    image_ids = ImageCache.open(w / "image_cache").ids
    commit_removal(w, [image_ids[r] for r in sorted(planted)])
    return w, docs, before, planted, n


def test_the_removal_is_recorded_and_keeps_the_derived_stores_valid(removal):
    w, _, _, removed, n = removal
    cache = ImageCache.open(w / "image_cache")
    assert set(np.flatnonzero(cache.removed).tolist()) == removed and cache.num_live == n - len(removed)
    assert verify_store(w / "image_cache") == []
    assert 0 < len(removed) < n - TOP_K  # enough live rows for k hits


@pytest.mark.parametrize("name", list(CASES))
def test_no_method_returns_a_removed_image_and_the_rest_ranks_as_before(removal, config, name):
    w, docs, before, removed, n = removal
    method, settings, identity = CASES[name]
    r = Retriever(_config(config, TOP_K, **settings), w, method)
    after = r.retrieve_many(docs)
    for doc, old, new in zip(docs, before[name], after):
        rows = [h.row for h in new.hits]
        assert not removed & set(rows), (doc.doc_id, removed & set(rows))
        live_old = [h for h in old.hits if h.row not in removed]
        assert len(rows) == min(TOP_K, len(live_old)) or not identity, doc.doc_id
        if identity:  # exact: the old full ranking with the removed rows deleted, scores and all
            assert rows == [h.row for h in live_old][:TOP_K], doc.doc_id
            np.testing.assert_allclose([h.score for h in new.hits], [h.score for h in live_old][:TOP_K],
                                       rtol=1e-5, atol=1e-6)
        if method == "cfir" and not doc.entities:  # the fallback searched every live row
            assert len(rows) == TOP_K and new.num_candidates == n - len(removed)


def test_searched_and_stored_lists_hold_live_rows_only_and_sr_is_exact_over_them(removal, config):
    """An unseen entity's list is its exact top-K over the live rows (K + R searched); a known entity's list is its
    stored list less the removed rows; SR ranks exactly the union of those."""
    w, docs, _, removed, _ = removal
    r = Retriever(_config(config, TOP_K, **EXACT), w)
    live = np.flatnonzero(~r.cache.removed)
    full = np.asarray(r.embeddings, np.float32)
    unseen = ["Zanzibar Quokka Society"]
    for doc in docs[:-1]:  # the test documents (the last: no entity)
        doc = DocumentInput(doc.text, doc.doc_id, entities=unseen + (doc.entities or []), summary=doc.summary)
        lists, _, used, _ = r.entities.candidates(doc.entities, r.stores.live, False)
        for entity, lst in zip(used, lists):
            row = r.entity_index.row(entity)
            if row is None:
                _, pos = exact_topk(r.entity_encoder.encode([entity]), full[live], r.entity_index.k)
                assert lst.tolist() == live[pos[0]].tolist(), entity
            else:
                stored = r.entity_index.candidates([row])[0]
                assert lst.tolist() == [c for c in stored.tolist() if c not in removed], entity
        union = np.unique(np.concatenate(lists))
        q = r.query_encoder.encode([doc.summary])[0]
        s = full[union] @ q
        order = np.lexsort((union, -s))[:TOP_K]
        assert [h.row for h in r.retrieve(doc).hits] == union[order].tolist()


def test_a_cut_index_still_reads_k_live_candidates_per_entity(removal, config):
    """retrieval.k below the built K: each list is read past the cut to its first k live rows."""
    w, docs, _, removed, _ = removal
    r = Retriever(_config(config, TOP_K, k=10, **IGNORE), w)
    whole = r.entity_index.with_k(0)
    filled = 0
    for doc in docs[:-1]:
        lists, _, used, _ = r.entities.candidates(doc.entities, r.stores.live, False)
        for entity, lst in zip(used, lists):
            stored = whole.candidates([r.entity_index.row(entity)])[0].tolist()
            want = [c for c in stored if c not in removed][:10]
            assert lst.tolist() == want, entity
            filled += len(want) == 10 and any(c in removed for c in stored[:10])
    assert filled, "the planted removals sit in some entity's first 10"


def test_the_third_stage_reorders_live_rows_only(removal, config):
    """The re-ranker (a head fitted for these sources, random weights: any order) re-scores SR's live top-N."""
    # why: flax models and the re-ranker store load only in this test
    from cfir_jax.model.rerank_head import RerankHead
    from cfir_jax.rerank.fit import save_reranker

    w, docs, _, removed, _ = removal
    cfg = _config(config, TOP_K, **IGNORE)
    cfg.retrieval.rerank.update(top_n=20, max_text_len=128)
    collect = Retriever(cfg, w, rerank_features=True)
    features = collect.rerank_feature_names
    head = RerankHead(len(features), 8, rngs=nnx.Rngs(0))
    save_reranker(w / "reranker", head, features, top_n=20, max_text_len=128, li_top=8,
                  sources=collect.rerank_sources(), sr_fusion=[1.0, 0.0])
    cfg.retrieval.rerank.enabled = True
    reranked = Retriever(cfg, w).retrieve_many(docs)
    sr = collect.retrieve_many(docs)
    for doc, x, s in zip(docs, reranked, sr):
        assert not removed & {h.row for h in x.hits}, doc.doc_id
        assert sorted(h.row for h in x.hits[:20]) == sorted(h.row for h in s.hits[:20])
        assert s.rerank_features is not None and len(s.rerank_features) == min(20, len(s.hits))


def test_training_never_targets_a_removed_image(removal, config):
    # why: the trainer's data loader, read here only
    from cfir_jax.training.data import load_train_data

    w, _, _, removed, _ = removal
    data = load_train_data(config, w)
    assert not removed & set(data.pair_image.tolist())
    assert data.live_rows is not None and not removed & set(data.live_rows.tolist())
    if data.eval is not None:
        ids = ImageCache.open(w / "image_cache").ids
        assert not {ids[r] for r in removed} & set(data.eval.image_ids)
