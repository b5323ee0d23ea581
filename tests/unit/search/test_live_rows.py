"""Removed rows (index.py --remove) never come back from a search, and the top k of the live rows stays exact."""

import numpy as np
import pytest

from cfir_jax.search.knn import ScannSearcher, synthetic_embeddings
from cfir_jax.search.live_rows import LiveRows
from cfir_jax.search.topk import exact_topk


def _removed(n: int, rows) -> np.ndarray:
    mask = np.zeros(n, bool)
    mask[list(rows)] = True
    return mask


def test_nothing_removed_is_the_identity():
    live = LiveRows(np.zeros(5, bool))
    rows = np.array([3, 1, 4], np.int32)
    assert live.keep(rows) is rows and live.fetch(7) == 7 and live.num_live == 5
    scores = np.array([[3.0, 2.0, 1.0]], np.float32)
    s, r = live.top(scores, rows[None], 2)
    assert r.tolist() == [[3, 1]] and s.tolist() == [[3.0, 2.0]]


def test_keep_drops_removed_rows_in_order_with_their_scores():
    live = LiveRows(_removed(10, [2, 7]))
    rows, scores = live.keep(np.array([7, 1, 2, 5], np.int32), np.array([0.9, 0.8, 0.7, 0.6], np.float32))
    assert rows.tolist() == [1, 5] and scores.tolist() == pytest.approx([0.8, 0.6])
    assert live.num_removed == 2 and live.num_live == 8 and live.fetch(3) == 5


def test_whole_cache_search_over_fetches_and_equals_the_search_of_the_live_rows():
    rng = np.random.default_rng(0)
    db = synthetic_embeddings(500, 16, clusters=8, seed=1)
    queries = rng.standard_normal((6, 16)).astype(np.float32)
    _, first = exact_topk(queries, db, 5)
    removed = _removed(len(db), np.unique(first))  # every query's best five: the planted answers
    live = LiveRows(removed)
    scores, rows = live.search(lambda fetch: exact_topk(queries, db, fetch), 20)
    keep = np.flatnonzero(~removed)
    want_s, want_pos = exact_topk(queries, db[keep], 20)
    assert rows.shape == (6, 20) and not removed[rows].any()
    np.testing.assert_array_equal(rows, keep[want_pos])
    np.testing.assert_allclose(scores, want_s, rtol=1e-6)


def test_fewer_live_rows_than_k_returns_every_live_row():
    db = synthetic_embeddings(12, 8, clusters=2, seed=2)
    live = LiveRows(_removed(12, range(0, 12, 2)))
    scores, rows = live.search(lambda fetch: exact_topk(db[:2], db, min(fetch, 12)), 10)
    assert rows.shape == (2, 6) and sorted(rows[0].tolist()) == list(range(1, 12, 2))


def test_padding_of_a_short_search_stays_padding():
    live = LiveRows(_removed(6, [0]))
    rows = np.array([[0, 3, -1], [5, 4, 3]], np.int32)
    scores = np.array([[0.9, 0.5, -np.inf], [0.8, 0.7, 0.6]], np.float32)
    s, r = live.top(scores, rows, 3)
    assert r.tolist() == [[3, -1, -1], [5, 4, 3]] and s[0, 1] == -np.inf


def test_scann_search_with_removed_rows_returns_k_live_neighbours():
    db = synthetic_embeddings(3000, 16, clusters=16, seed=3)
    searcher = ScannSearcher.build(db, 50)
    queries = db[:4]
    _, first = searcher.search(queries, 10)
    removed = _removed(len(db), np.unique(first))
    _, rows = LiveRows(removed).search(lambda fetch: searcher.search(queries, fetch), 50)
    assert rows.shape == (4, 50) and (rows >= 0).all() and not removed[rows].any()
