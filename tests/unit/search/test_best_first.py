"""The one tie rule of the host's top-k (cfir_jax.search.topk.best_first): best score first, ties to the lower row,
padding (row -1) after the real rows; BM25's top_k, the cluster's merge, the entity-only ranking and ScaNN's tail
all order by it."""

import numpy as np

from cfir_jax.cluster.scoring import merge_ranked
from cfir_jax.search.bm25 import top_k
from cfir_jax.search.topk import best_first


def _tied(rng, shape):
    return rng.integers(0, 4, shape).astype(np.float32) / 4  # few distinct scores: many ties


def test_ties_go_to_the_lower_row_and_padding_last():
    scores = np.array([0.5, 0.9, 0.5, 0.9, -np.inf, -np.inf], np.float32)
    rows = np.array([7, 9, 3, 2, -1, 4])
    assert best_first(scores, rows).tolist() == [3, 1, 2, 0, 5, 4]
    assert best_first(scores, rows, 3).tolist() == [3, 1, 2]
    assert best_first(np.zeros(0, np.float32), np.zeros(0, np.int32)).tolist() == []


def test_every_row_of_a_matrix_is_ordered_alone():
    rng = np.random.default_rng(0)
    scores, rows = _tied(rng, (5, 40)), rng.permutation(200).reshape(5, 40).astype(np.int32)
    rows[:, -3:] = -1
    order = best_first(scores, rows, 10)
    for q in range(5):
        want = sorted(range(40), key=lambda j: (-scores[q, j], rows[q, j] < 0, rows[q, j]))[:10]
        assert order[q].tolist() == want


def test_bm25_and_the_cluster_merge_keep_the_rule():
    rng = np.random.default_rng(1)
    scores, rows = _tied(rng, 300), rng.permutation(1000)[:300].astype(np.int32)
    s, r = top_k(scores, rows, 25)
    want = sorted(zip(-scores, rows))[:25]
    assert r.tolist() == [int(x) for _, x in want] and s.tolist() == [float(-x) for x, _ in want]
    parts = np.array_split(np.arange(300), 4)
    kept, merged = merge_ranked([scores[p] for p in parts], [np.where(p % 50 == 0, -1, rows[p]) for p in parts], 25)
    live = [(-scores[j], rows[j]) for j in range(300) if j % 50]
    assert merged.tolist() == [int(x) for _, x in sorted(live)[:25]] and (merged >= 0).all()
    assert kept.tolist() == [float(-x) for x, _ in sorted(live)[:25]]
