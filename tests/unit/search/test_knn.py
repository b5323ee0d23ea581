import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
import pytest

from cfir_jax.core.errors import CfirError
from cfir_jax.search.knn import ScannConfig, ScannSearcher, recall_at_k, synthetic_embeddings
from cfir_jax.search.topk import exact_topk


def _numpy_topk(queries, database, k):
    scores = queries @ np.asarray(database, np.float32).T
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(scores, order, axis=1), order


@pytest.mark.parametrize("n,block,k", [(1000, 256, 10), (1037, 256, 300), (50, 64, 50), (700, 700, 5)])
def test_exact_topk_matches_numpy_sort(n, block, k):
    rng = np.random.default_rng(n)
    db = rng.standard_normal((n, 32)).astype(np.float32)
    q = rng.standard_normal((7, 32)).astype(np.float32)
    scores, idx = exact_topk(q, db, k, block_size=block, query_block=4)
    ref_scores, ref_idx = _numpy_topk(q, db, k)
    assert idx.dtype == np.int32 and idx.shape == (7, k)
    np.testing.assert_array_equal(idx, ref_idx)
    np.testing.assert_allclose(scores, ref_scores, rtol=1e-5, atol=1e-5)


def test_exact_topk_reads_float16_memmap(tmp_path):
    db = synthetic_embeddings(900, 16, dtype=np.float16, seed=3)
    np.save(tmp_path / "db.npy", db)
    mm = np.load(tmp_path / "db.npy", mmap_mode="r")
    q = synthetic_embeddings(5, 16, seed=4)
    _, idx = exact_topk(q, mm, 20, block_size=128)
    np.testing.assert_array_equal(idx, _numpy_topk(q, db, 20)[1])


def test_exact_topk_clamps_k_to_database_size():
    db = np.eye(4, dtype=np.float32)
    scores, idx = exact_topk(db[:2], db, 10)
    assert idx.shape == (2, 4)
    assert idx[0, 0] == 0 and idx[1, 0] == 1


def test_exact_topk_rejects_dim_mismatch():
    with pytest.raises(CfirError, match="dim"):
        exact_topk(np.zeros((2, 8), np.float32), np.zeros((10, 16), np.float32), 3)


def _default_scann_recall(n: int, n_queries: int, k: int, seed: int) -> float:
    """recall@k of ScaNN at the default config over n clustered 64-d rows."""
    db = synthetic_embeddings(n, 64, seed=seed)
    q = synthetic_embeddings(n_queries, 64, seed=seed + 1)
    _, exact = exact_topk(q, db, k)
    _, approx = ScannSearcher.build(db, k).search(q, k)
    return recall_at_k(approx, exact)


def test_scann_recall_on_clustered_data_at_defaults():
    assert _default_scann_recall(20_000, 64, 100, seed=0) >= 0.95


def test_scann_serialize_roundtrip_after_move(tmp_path):
    db = synthetic_embeddings(3000, 32, seed=2)
    q = synthetic_embeddings(8, 32, seed=5)
    searcher = ScannSearcher.build(db, 10, ScannConfig(num_leaves=30))
    searcher.serialize(tmp_path / "a")
    os.rename(tmp_path / "a", tmp_path / "b")
    loaded = ScannSearcher.load(tmp_path / "b")
    np.testing.assert_array_equal(loaded.search(q, 10)[1], searcher.search(q, 10)[1])
    assert loaded.config.num_leaves == 30


def test_scann_load_of_missing_dir_is_a_cfir_error(tmp_path):
    with pytest.raises(CfirError, match="no serialized ScaNN"):
        ScannSearcher.load(tmp_path)


def test_recall_at_k_counts_overlap():
    assert recall_at_k(np.array([[1, 2, 3], [4, 5, 6]]), np.array([[3, 2, 9], [7, 8, 9]])) == pytest.approx(2 / 6)


@pytest.mark.parametrize("n,k", [(100_000, 100), (100_000, 1000), (100_000, 10_000), (1_000_000, 10_000), (3000, 5)])
def test_resolved_searches_enough_leaves_to_hold_the_reorder_candidates(n, k):
    c = ScannConfig().resolved(n, k)
    assert c.reorder == min(n, max(4 * k, 1000))  # the floor: recall@100 at 768 dims was 0.89 with 400
    assert c.num_leaves_to_search * n / c.num_leaves >= min(n, 1.5 * c.reorder)
    assert c.num_leaves_to_search >= c.num_leaves / 5 and c.num_leaves_to_search <= c.num_leaves


def test_resolved_keeps_explicit_settings():
    c = ScannConfig(num_leaves=50, num_leaves_to_search=7, reorder=123).resolved(100_000, 1000)
    assert (c.num_leaves, c.num_leaves_to_search, c.reorder) == (50, 7, 123)


def test_scann_recall_when_k_is_a_tenth_of_the_database():
    assert _default_scann_recall(10_000, 32, 1000, seed=6) >= 0.95


def test_top_k_positions_breaks_ties_by_position_in_the_order_and_at_the_cut():
    """One process's exact SR and the shards' merge both send ties to the lower row: a tie inside a document's top
    1,000 ordered otherwise made the cluster's answer differ from one process's (the synthetic 1M index)."""
    from cfir_jax.search.topk import top_k_positions

    scores = np.zeros(1000, np.float32)
    scores[[700, 5]] = 1.0
    assert top_k_positions(scores, 10).tolist() == [5, 700, 0, 1, 2, 3, 4, 6, 7, 8]
    scores = np.random.default_rng(0).integers(0, 4, 5000).astype(np.float32)  # many ties at every score
    expected = np.lexsort((np.arange(scores.size), -scores))[:300]
    assert top_k_positions(scores, 300).tolist() == expected.tolist()
    assert top_k_positions(scores[:7], 300).tolist() == np.lexsort((np.arange(7), -scores[:7])).tolist()
