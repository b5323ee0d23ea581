import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json

import numpy as np
import pytest

from cfir_jax.builders.entity_index_build import EntityIndexSettings, build_entity_index
from cfir_jax.builders.entity_index_update import (
    StageSettings,
    stage_compacted,
    stage_entities_added,
    stage_images_added,
    stage_images_removed,
)
from cfir_jax.core.errors import CfirError
from cfir_jax.search.knn import ScannSearcher, search_with_tail, synthetic_embeddings
from cfir_jax.search.topk import exact_topk
from cfir_jax.stores.entity_index import EntityIndex

FP = "fp"
SOURCES = dict(documents="all", entities_sha="e1")


def _build(path, texts, ents, images, k, backend="exact", chunk_size=16, cache="c1", **kw) -> EntityIndex:
    build_entity_index(path, texts, ents, images, EntityIndexSettings(k, backend=backend, chunk_size=chunk_size, **kw),
                       model_fingerprint=FP, sources=SOURCES | {"cache_fingerprint": cache})
    return EntityIndex.open(path)


def _stage(tmp_path, name="stage"):
    out = tmp_path / name
    out.mkdir()
    return out


def _assert_same_lists(a: EntityIndex, b: EntityIndex) -> None:
    assert a.vocab == b.vocab
    np.testing.assert_array_equal(a.offsets, b.offsets)
    np.testing.assert_array_equal(a.candidates_array, b.candidates_array)
    # bit for bit, not close: compared as raw float16 patterns
    np.testing.assert_array_equal(np.asarray(a.scores_array).view(np.uint16),
                                  np.asarray(b.scores_array).view(np.uint16))


def _with_ties(images: np.ndarray, rng, copies: int) -> np.ndarray:
    """Rows duplicated further down (equal scores for every entity): the order of ties is tested too."""
    src = rng.choice(len(images), copies, replace=False)
    dst = rng.choice(len(images), copies, replace=False)
    images = images.copy()
    images[dst] = images[src]
    return images


@pytest.mark.parametrize("n_old,n_new,k,e", [(200, 300, 20, 40), (10, 60, 30, 21), (120, 121, 120, 5)],
                         ids=["grow", "k-above-n-old", "k-is-n-old"])
def test_images_added_on_exact_equals_a_scratch_build_bit_for_bit(tmp_path, n_old, n_new, k, e):
    rng = np.random.default_rng(n_old)
    images = _with_ties(synthetic_embeddings(n_new, 16, seed=3, dtype=np.float16), rng, n_new // 5)
    ents = synthetic_embeddings(e, 16, seed=4)
    texts = [f"e{i}" for i in range(e)]
    old = _build(tmp_path / "old", texts, ents, images[:n_old], k)
    out = _stage(tmp_path)
    manifest = stage_images_added(old, out, images, n_old, settings=StageSettings(cache_fingerprint="c2",
                                  sources=SOURCES))
    scratch = _build(tmp_path / "scratch", texts, ents, images, k, cache="c2")
    staged = EntityIndex.open(out)
    _assert_same_lists(staged, scratch)
    for key in ("n_images", "k", "k_requested", "n_candidates", "cache_fingerprint", "entities_sha", "documents",
                "model_fingerprint", "backend", "recall_at_k", "has_embeddings"):
        assert manifest[key] == scratch.manifest[key], key
    np.testing.assert_array_equal(staged.entity_embeddings(), scratch.entity_embeddings())
    assert manifest["added_images"] == n_new - n_old
    assert (old.directory / "manifest.json").is_file() and old.manifest["n_images"] == n_old  # old store untouched


def test_add_and_remove_across_the_32768_row_block_equal_scratch_builds(tmp_path):
    """The cache grows past exact_topk's block (32768 rows: the scratch build's blocks change shape), then loses
    rows (lists that held them refilled, the others copied); both equal scratch builds over the live rows."""
    rng = np.random.default_rng(0)
    n_old, n_new, e, k = 30000, 34000, 40, 50
    images = _with_ties(synthetic_embeddings(n_new, 8, seed=5, dtype=np.float16), rng, 500)
    ents = synthetic_embeddings(e, 8, seed=6)
    texts = [f"e{i}" for i in range(e)]
    old = _build(tmp_path / "old", texts, ents, images[:n_old], k)
    added = stage_images_added(old, _stage(tmp_path, "added"), images, n_old,
                               settings=StageSettings(cache_fingerprint="c2", sources=SOURCES))
    _assert_same_lists(EntityIndex.open(tmp_path / "added"), _build(tmp_path / "s1", texts, ents, images, k))
    assert added["n_images"] == n_new

    grown = EntityIndex.open(tmp_path / "added")
    removed = np.zeros(n_new, bool)
    removed[np.unique(np.asarray(grown.candidates([0, 1, 2])).ravel()[::3])] = True  # three lists lose rows
    removed[rng.choice(n_new, 200, replace=False)] = True
    stage_images_removed(grown, _stage(tmp_path, "removed"), removed, images,
                         settings=StageSettings(cache_fingerprint="c2", sources=SOURCES))
    live = np.flatnonzero(~removed)
    scratch = _build(tmp_path / "s2", texts, ents, images[live], k)
    staged = EntityIndex.open(tmp_path / "removed")
    np.testing.assert_array_equal(staged.offsets, scratch.offsets)
    np.testing.assert_array_equal(staged.candidates_array, live[scratch.candidates_array])
    np.testing.assert_array_equal(np.asarray(staged.scores_array).view(np.uint16),
                                  np.asarray(scratch.scores_array).view(np.uint16))


@pytest.mark.parametrize("drop_entities", [False, True], ids=["all-entities", "entities-dropped"])
def test_removal_refills_lists_as_a_scratch_build_over_the_live_rows(tmp_path, drop_entities):
    rng = np.random.default_rng(1)
    n, e, k = 400, 37, 25
    images = _with_ties(synthetic_embeddings(n, 16, seed=7, dtype=np.float16), rng, 60)
    ents = synthetic_embeddings(e, 16, seed=8)
    texts = [f"e{i}" for i in range(e)]
    old = _build(tmp_path / "old", texts, ents, images, k)
    removed = np.zeros(n, bool)
    removed[np.asarray(old.candidates([4]))[0][:10]] = True  # entity 4 loses its 10 best
    removed[rng.choice(n, 30, replace=False)] = True
    keep = np.ones(e, bool)
    if drop_entities:
        keep[[0, 5, 17, 36]] = False
    manifest = stage_images_removed(old, _stage(tmp_path), removed, images, keep_entities=keep if drop_entities
                                    else None)
    live = np.flatnonzero(~removed)
    kept = np.flatnonzero(keep)
    scratch = _build(tmp_path / "scratch", [texts[i] for i in kept], ents[kept], images[live], k)
    staged = EntityIndex.open(tmp_path / "stage")
    assert staged.vocab == scratch.vocab and manifest["removed_images"] == removed.sum()
    assert manifest["removed_entities"] == (~keep).sum() and manifest["n_images"] == n
    np.testing.assert_array_equal(staged.candidates_array, live[scratch.candidates_array])
    np.testing.assert_array_equal(np.asarray(staged.scores_array).view(np.uint16),
                                  np.asarray(scratch.scores_array).view(np.uint16))
    np.testing.assert_array_equal(staged.entity_embeddings(), ents[kept])
    assert not removed[staged.candidates_array].any()

    # Compaction: the rows renumbered; the lists are then those of a scratch build over the compacted cache.
    row_map = np.full(n, -1, np.int64)
    row_map[live] = np.arange(len(live))
    compacted = stage_compacted(staged, _stage(tmp_path, "compact"), row_map, cache_fingerprint="c3")
    _assert_same_lists(EntityIndex.open(tmp_path / "compact"), scratch)
    assert compacted["n_images"] == len(live) and compacted["cache_fingerprint"] == "c3"
    with pytest.raises(CfirError, match="stage the removal"):
        stage_compacted(old, _stage(tmp_path, "refused"), row_map)


def test_an_index_without_stored_embeddings_is_encoded_again(tmp_path):
    images = synthetic_embeddings(300, 16, seed=9, dtype=np.float16)
    ents = synthetic_embeddings(20, 16, seed=10)
    texts = [f"e{i}" for i in range(20)]
    _build(tmp_path / "old", texts, ents, images[:200], 10)
    manifest = json.loads((tmp_path / "old" / "manifest.json").read_text())
    (tmp_path / "old" / "manifest.json").write_text(json.dumps(manifest | {"has_embeddings": False}))
    (tmp_path / "old" / "entity_embeddings.npy").unlink()
    old = EntityIndex.open(tmp_path / "old")
    with pytest.raises(CfirError, match="built without entity_embeddings.npy; pass the index encoder"):
        stage_images_added(old, _stage(tmp_path, "a"), images, 200, settings=StageSettings(cache_fingerprint="c2"))
    stage_images_added(old, _stage(tmp_path, "b"), images, 200, settings=StageSettings(cache_fingerprint="c2",
                       encode=lambda batch: ents[[texts.index(t) for t in batch]]))
    _assert_same_lists(EntityIndex.open(tmp_path / "b"), _build(tmp_path / "scratch", texts, ents, images, 10))
    assert EntityIndex.open(tmp_path / "b").has_embeddings


@pytest.fixture(scope="module")
def scann_world():
    rng = np.random.default_rng(2)
    n_old, n_new, e = 3000, 3500, 60
    images = synthetic_embeddings(n_new, 32, seed=11)
    ents = synthetic_embeddings(e, 32, seed=12)
    # New images planted next to some entities: recall counts them, and an unseen entity finds its own.
    unseen = synthetic_embeddings(1, 32, seed=13)[0]
    images[n_old + 7] = unseen
    for j in range(0, e, 3):
        images[n_old + 100 + j] = ents[j] + 0.01 * rng.standard_normal(32).astype(np.float32)
    images /= np.linalg.norm(images, axis=1, keepdims=True)
    return images.astype(np.float16), ents, [f"e{i}" for i in range(e)], unseen, n_old


def test_scann_add_keeps_recall_and_the_tail_is_searched_exactly(tmp_path, scann_world):
    images, ents, texts, unseen, n_old = scann_world
    old = _build(tmp_path / "old", texts, ents, images[:n_old], 20, backend="scann", recall_sample=60)
    assert old.searcher_rows == n_old
    manifest = stage_images_added(old, _stage(tmp_path), images, n_old, settings=StageSettings(cache_fingerprint="c2"))
    staged = EntityIndex.open(tmp_path / "stage")
    assert manifest["searcher_rows"] == n_old and manifest["has_searcher"] and manifest["n_images"] == len(images)
    assert manifest["recall_at_k"] >= old.manifest["recall_at_k"]
    for j in range(0, len(texts), 3):  # every planted image is in its entity's list, first
        assert staged.candidates([j])[0][0] == n_old + 100 + j
    searcher = ScannSearcher.load(staged.searcher_dir())
    s, found = search_with_tail(searcher, images, unseen[None], 20)
    assert found[0, 0] == n_old + 7 and np.all(np.diff(s[0]) <= 0)
    _, exact = exact_topk(unseen[None], images, 20)
    assert len(np.intersect1d(found, exact)) >= 18
    removed = np.zeros(len(images), bool)
    removed[[n_old + 7, *found[0, 1:4]]] = True
    _, found = search_with_tail(searcher, images, unseen[None], 20, removed)
    assert not removed[found[0]].any() and (found >= 0).all()


def test_scann_entities_added_and_images_removed(tmp_path, scann_world):
    images, ents, texts, unseen, n_old = scann_world
    old = _build(tmp_path / "old", texts[:40], ents[:40], images[:n_old], 20, backend="scann")
    grown = stage_images_added(old, _stage(tmp_path, "grown"), images, n_old,
                               settings=StageSettings(cache_fingerprint="c2"))
    assert grown["searcher_rows"] == n_old
    grown = EntityIndex.open(tmp_path / "grown")
    added = stage_entities_added(grown, _stage(tmp_path, "ents"), texts[30:] + ["unseen"],
                                 np.concatenate([ents[30:], unseen[None]]), images)
    index = EntityIndex.open(tmp_path / "ents")
    assert added["added_entities"] == 21 and index.vocab == texts + ["unseen"]
    assert index.candidates([index.row("unseen")])[0][0] == n_old + 7  # found in the tail the tree does not cover
    assert index.candidates([42])[0][0] == n_old + 142
    np.testing.assert_array_equal(index.entity_embeddings(), np.concatenate([ents, unseen[None]]))

    removed = np.zeros(len(images), bool)
    removed[[n_old + 7, n_old + 142, *np.asarray(index.candidates([3]))[0][:5]]] = True
    manifest = stage_images_removed(index, _stage(tmp_path, "removed"), removed, images)
    after = EntityIndex.open(tmp_path / "removed")
    assert not removed[after.candidates_array].any() and (after.lengths == 20).all()
    assert manifest["recall_at_k"] >= 0.9
    np.testing.assert_array_equal(after.candidates([10])[0], index.candidates([10])[0])  # untouched list kept


def test_staging_needs_an_empty_directory_and_the_old_row_count(tmp_path):
    images = synthetic_embeddings(100, 8, seed=1, dtype=np.float16)
    old = _build(tmp_path / "old", ["a", "b"], synthetic_embeddings(2, 8, seed=2), images[:50], 5)
    out = _stage(tmp_path)
    (out / "x").write_text("")
    with pytest.raises(CfirError, match="must exist and be empty"):
        stage_images_added(old, out, images, 50, settings=StageSettings(cache_fingerprint="c"))
    with pytest.raises(CfirError, match="n_old=40 but .* indexes 50 rows"):
        stage_images_added(old, _stage(tmp_path, "b"), images, 40, settings=StageSettings(cache_fingerprint="c"))
