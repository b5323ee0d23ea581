import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json

import numpy as np
import pytest

from cfir_jax.builders.entity_index_build import EntityIndexSettings, build_entity_index
from cfir_jax.builders.entity_index_update import stage_entities_added
from cfir_jax.core.errors import CfirError, StoreError
from cfir_jax.search.knn import ScannConfig, ScannSearcher, drop_padding, synthetic_embeddings
from cfir_jax.search.topk import exact_topk
from cfir_jax.stores.entity_index import EntityIndex

FP = "beit3-test-fingerprint"


@pytest.fixture(scope="module")
def data():
    images = synthetic_embeddings(3000, 32, seed=0, dtype=np.float16)
    ents = synthetic_embeddings(50, 32, seed=1)
    texts = [f"entity {i}" for i in range(len(ents))]
    return images, ents, texts


def test_exact_index_candidates_equal_exact_search(tmp_path, data):
    images, ents, texts = data
    recall = build_entity_index(tmp_path / "idx", texts, ents, images, EntityIndexSettings(40, backend="exact",
                                chunk_size=16), model_fingerprint=FP)
    index = EntityIndex.open(tmp_path / "idx", expect_fingerprint=FP, expect_dim=32)
    scores, ref = exact_topk(ents, images, 40)
    assert recall == 1.0 and index.k == 40 and len(index) == 50
    np.testing.assert_array_equal(np.stack(index.candidates(np.arange(50))), ref)
    np.testing.assert_allclose(index.scores([3])[0], scores[3], atol=2e-3)
    assert index.row("entity 7") == 7 and index.row("never seen") is None
    assert not (tmp_path / ".idx.building").exists()


def test_exact_index_uses_the_device_cache_on_accelerators(tmp_path, data, monkeypatch):
    from cfir_jax.search import device_sr as sr_device

    images, ents, texts = data
    calls = []
    full_topk = sr_device.DeviceCache.full_topk
    monkeypatch.setattr(sr_device, "has_accelerator", lambda: True)
    monkeypatch.setattr(sr_device.DeviceCache, "full_topk",
                        lambda self, q, k: calls.append(len(q)) or full_topk(self, q, k))
    build_entity_index(tmp_path / "idx", texts, ents, images, EntityIndexSettings(40, backend="exact", chunk_size=16),
                       model_fingerprint=FP)
    assert sum(calls) == len(ents)
    np.testing.assert_array_equal(EntityIndex.open(tmp_path / "idx").candidates(np.arange(50)),
                                  exact_topk(ents, images, 40)[1])


def test_scann_index_records_recall_and_stores_a_searcher(tmp_path, data):
    images, ents, texts = data
    recall = build_entity_index(tmp_path / "idx", texts, ents, images, EntityIndexSettings(20, recall_sample=32),
                                model_fingerprint=FP)
    index = EntityIndex.open(tmp_path / "idx")
    assert index.manifest["recall_at_k"] == recall and recall >= 0.9
    _, found = ScannSearcher.load(index.searcher_dir()).search(ents[:4], 20)
    _, exact = exact_topk(ents[:4], images, 20)
    assert np.mean([len(np.intersect1d(a, b)) for a, b in zip(found, exact)]) >= 18


def test_interrupted_build_resumes_to_the_same_index(tmp_path, data):
    images, ents, texts = data
    calls = []

    def crash(chunk):
        calls.append(chunk)
        if chunk == 1:
            raise KeyboardInterrupt("simulated crash")

    with pytest.raises(KeyboardInterrupt):
        build_entity_index(tmp_path / "a", texts, ents, images, EntityIndexSettings(30, backend="exact",
                           chunk_size=10), model_fingerprint=FP, on_chunk=crash)
    assert not (tmp_path / "a").exists()
    resumed = []
    build_entity_index(tmp_path / "a", texts, ents, images, EntityIndexSettings(30, backend="exact", chunk_size=10),
                       model_fingerprint=FP, on_chunk=resumed.append)
    assert resumed == [2, 3, 4]  # chunks 0 and 1 were on disk before the crash
    build_entity_index(tmp_path / "b", texts, ents, images, EntityIndexSettings(30, backend="exact", chunk_size=10),
                       model_fingerprint=FP)
    a, b = EntityIndex.open(tmp_path / "a"), EntityIndex.open(tmp_path / "b")
    _assert_same_index(a, b)


def _assert_same_index(a: EntityIndex, b: EntityIndex) -> None:
    np.testing.assert_array_equal(a.offsets, b.offsets)
    np.testing.assert_array_equal(a.candidates_array, b.candidates_array)
    np.testing.assert_array_equal(a.scores_array, b.scores_array)


def test_fingerprint_mismatch_is_refused_in_one_line(tmp_path, data):
    images, ents, texts = data
    build_entity_index(tmp_path / "idx", texts, ents, images, EntityIndexSettings(5, backend="exact"),
                       model_fingerprint=FP)
    with pytest.raises(StoreError, match="model_fingerprint") as e:
        EntityIndex.open(tmp_path / "idx", expect_fingerprint="other-model")
    assert "\n" not in str(e.value)


def test_dim_mismatch_is_refused(tmp_path, data):
    images, ents, texts = data
    build_entity_index(tmp_path / "idx", texts, ents, images, EntityIndexSettings(5, backend="exact"),
                       model_fingerprint=FP)
    with pytest.raises(StoreError, match="dim"):
        EntityIndex.open(tmp_path / "idx", expect_dim=64)


def test_incomplete_store_is_refused(tmp_path):
    (tmp_path / "idx").mkdir()
    with pytest.raises(StoreError, match="incomplete"):
        EntityIndex.open(tmp_path / "idx")


def test_duplicate_entity_texts_are_an_error(tmp_path, data):
    images, ents, _ = data
    with pytest.raises(CfirError, match="duplicate entity text 'x'"):
        build_entity_index(tmp_path / "idx", ["x", "y", "x"], ents[:3], images, EntityIndexSettings(5),
                           model_fingerprint=FP)


def test_k_above_image_count_is_clamped(tmp_path, data):
    images, ents, texts = data
    build_entity_index(tmp_path / "idx", texts[:3], ents[:3], images[:25], EntityIndexSettings(100, backend="exact"),
                       model_fingerprint=FP)
    index = EntityIndex.open(tmp_path / "idx")
    assert index.k == 25 and index.manifest["k_requested"] == 100


def test_append_equals_building_everything_at_once(tmp_path, data):
    images, ents, texts = data
    build_entity_index(tmp_path / "inc", texts[:30], ents[:30], images, EntityIndexSettings(15, backend="exact"),
                       model_fingerprint=FP)
    # Rows 20..29 are already indexed: append must skip them and add only 30..49.
    (tmp_path / "staged").mkdir()
    added = stage_entities_added(EntityIndex.open(tmp_path / "inc", expect_fingerprint=FP), tmp_path / "staged",
                                 texts[20:], ents[20:], images)["added_entities"]
    build_entity_index(tmp_path / "all", texts, ents, images, EntityIndexSettings(15, backend="exact"),
                       model_fingerprint=FP)
    inc, full = EntityIndex.open(tmp_path / "staged"), EntityIndex.open(tmp_path / "all")
    assert added == 20 and inc.vocab == full.vocab
    _assert_same_index(inc, full)
    assert inc.manifest["n_entities"] == 50


def test_candidates_of_unknown_row_is_an_error(tmp_path, data):
    images, ents, texts = data
    build_entity_index(tmp_path / "idx", texts[:5], ents[:5], images, EntityIndexSettings(5, backend="exact"),
                       model_fingerprint=FP)
    with pytest.raises(CfirError, match="entity rows"):
        EntityIndex.open(tmp_path / "idx").candidates([7])


def _starved_scann(k: int) -> ScannConfig:
    """A tree searched in one of 60 leaves: far fewer than k points are reachable, so ScaNN pads its answers. ScaNN's
    k-means is not seeded: in some builds a leaf is empty and an entity routed to it gets no candidates at all (seen
    once in about a dozen builds), a list of length 0 that the store and ER's union hold like any other."""
    return ScannConfig(num_leaves=60, num_leaves_to_search=1, reorder=k, min_rows_for_tree=1)


def test_scann_short_answers_are_stored_ragged_without_padding(tmp_path, data):
    images, ents, texts = data
    k = 500
    build_entity_index(tmp_path / "idx", texts, ents, images, EntityIndexSettings(k, scann_config=_starved_scann(k)),
                       model_fingerprint=FP)
    index = EntityIndex.open(tmp_path / "idx")
    lists, scores = index.candidates(np.arange(len(texts))), index.scores(np.arange(len(texts)))
    assert index.lengths.min() < k, "the test needs ScaNN to return fewer than K for some entity"
    assert index.lengths.max() <= k and len(index.candidates_array) == index.lengths.sum()
    for row, (cand, sc) in enumerate(zip(lists, scores)):
        assert len(cand) == index.lengths[row] and np.all((cand >= 0) & (cand < len(images)))
        assert len(np.unique(cand)) == len(cand) and np.all(np.isfinite(sc))
        # Each stored candidate's score is its real dot product (ScaNN's padding was id 0 with a NaN distance).
        np.testing.assert_allclose(sc, images[cand].astype(np.float32) @ ents[row], atol=2e-2)
    _, found = ScannSearcher.load(index.searcher_dir()).search(ents[:8], k)
    kept = drop_padding(found)
    assert (found == -1).any() and sum(map(len, kept)) > 0 and all(np.all(r >= 0) for r in kept)
    assert [len(r) for r in kept] == [int((row >= 0).sum()) for row in found]


def test_index_of_the_padded_format_is_refused_in_one_line(tmp_path, data):
    images, ents, texts = data
    build_entity_index(tmp_path / "idx", texts[:5], ents[:5], images, EntityIndexSettings(5, backend="exact"),
                       model_fingerprint=FP)
    manifest = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    (tmp_path / "idx" / "manifest.json").write_text(json.dumps(manifest | {"format_version": 1}))
    with pytest.raises(StoreError, match="format version 1 .* rebuild") as e:
        EntityIndex.open(tmp_path / "idx")
    assert "\n" not in str(e.value)


def test_a_cut_exact_index_equals_an_index_built_at_that_k(tmp_path, data):
    """Table 4 from one index: on the exact backend, the K=40 index read at K=10 (retrieval.k) is the K=10 index,
    candidates and scores; a cut above the built K is refused in one line."""
    images, ents, texts = data
    build_entity_index(tmp_path / "k40", texts, ents, images, EntityIndexSettings(40, backend="exact"),
                       model_fingerprint=FP)
    build_entity_index(tmp_path / "k10", texts, ents, images, EntityIndexSettings(10, backend="exact"),
                       model_fingerprint=FP)
    big, small = EntityIndex.open(tmp_path / "k40"), EntityIndex.open(tmp_path / "k10")
    cut = big.with_k(10)
    rows = np.arange(len(texts))
    assert cut.k == 10 and cut.built_k == 40 and big.k == 40
    for a, b in zip(cut.candidates(rows), small.candidates(rows)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(cut.scores(rows), small.scores(rows)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(cut.lengths, small.lengths)
    assert cut.with_k(0).k == 40 and big.with_k(40).k == 40
    with pytest.raises(CfirError, match="retrieval.k=41: the entity index .* built with K=40"):
        big.with_k(41)
    assert big.er_note() == "ER: exact top-40 per entity (the paper's)"
    assert cut.er_note() == "ER: exact top-40 per entity (the paper's), read at K=10 (retrieval.k)"


def test_er_note_states_scann_recall_and_the_exact_rebuild(tmp_path, data):
    images, ents, texts = data
    recall = build_entity_index(tmp_path / "idx", texts, ents, images, EntityIndexSettings(20, recall_sample=32),
                                model_fingerprint=FP)
    note = EntityIndex.open(tmp_path / "idx").er_note()
    assert note == (f"ER: ScaNN top-20 per entity, recall@20 {recall:.4f} against exact search on 32 sampled "
                    "entities; the paper's ER is exact: rebuild with index.py "
                    "--config.index.entity_index.backend=exact")


@pytest.mark.parametrize("accelerator", [True, False], ids=["accelerator", "cpu"])
def test_auto_backend_is_exact_on_accelerators_scann_on_cpu_hosts_and_the_manifest_says_which(
        tmp_path, data, monkeypatch, accelerator):
    """index.entity_index.backend='auto' (the default): the index stage builds exact top-K where a GPU or TPU is
    present and ScaNN on a CPU host; the manifest records the backend used and the setting that chose it, and a
    rerun on the same machine finds the index current."""
    import ml_collections

    from cfir_jax.builders import entity_index_update
    from cfir_jax.builders.candidate_search import resolve_backend
    from cfir_jax.search import device_sr
    from cfir_jax.stores.layout import Layout

    images, ents, texts = data
    monkeypatch.setattr(device_sr, "has_accelerator", lambda: accelerator)
    encoder = type("Encoder", (), {"encode": staticmethod(lambda batch: ents[[texts.index(t) for t in batch]])})
    monkeypatch.setattr(entity_index_update, "entity_encoder", lambda config, layout, corpus: (encoder, FP))
    monkeypatch.setattr(entity_index_update, "check_cache_encoder", lambda config, layout, cache: None)
    monkeypatch.setattr(entity_index_update, "indexed_entities", lambda config, corpus, entities: texts)
    from configs.base import get_config

    config = get_config("runlocal")
    assert config.index.entity_index.backend == "auto"
    config.index.entity_index.update(k=40, chunk_size=16)
    cache = ml_collections.ConfigDict(dict(embeddings=images, content_fingerprint="cache-1"))
    layout = Layout.of(tmp_path)
    index = entity_index_update.build_entity_index(config, layout, None, None, cache)
    want = "exact" if accelerator else "scann"
    assert resolve_backend("auto") == want and resolve_backend("scann") == "scann"
    assert (index.manifest["backend"], index.manifest["backend_setting"]) == (want, "auto")
    if accelerator:
        np.testing.assert_array_equal(np.stack(index.candidates(np.arange(50))), exact_topk(ents, images, 40)[1])
    else:
        assert index.manifest["has_searcher"] and index.manifest["recall_at_k"] is not None
    before = (tmp_path / "entity_index" / "manifest.json").stat().st_mtime_ns
    entity_index_update.build_entity_index(config, layout, None, None, cache)
    assert (tmp_path / "entity_index" / "manifest.json").stat().st_mtime_ns == before
    with pytest.raises(CfirError, match="index.entity_index.backend='faiss'"):
        resolve_backend("faiss")


def test_the_build_keeps_the_encoded_entities(tmp_path, data):
    """entity_embeddings.npy holds what was searched, in vocab order, whether given or encoded chunk by chunk;
    a file of another shape is refused in one line."""
    images, ents, texts = data
    encode = lambda batch: ents[[texts.index(t) for t in batch]]  # noqa: E731
    build_entity_index(tmp_path / "idx", texts, encode, images, EntityIndexSettings(5, backend="exact", chunk_size=16),
                       model_fingerprint=FP)
    index = EntityIndex.open(tmp_path / "idx")
    assert index.has_embeddings and index.manifest["chunk_size"] == 16 and index.searcher_rows == 0
    np.testing.assert_array_equal(index.entity_embeddings(), ents)
    np.save(tmp_path / "idx" / "entity_embeddings.npy", ents[:3])
    with pytest.raises(StoreError, match="entity_embeddings.npy is float32 .3, 32. but the manifest") as e:
        index.entity_embeddings()
    assert "\n" not in str(e.value)
