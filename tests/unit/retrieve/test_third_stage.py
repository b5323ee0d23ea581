"""The third stage's pieces that need no index: the entity evidence features against a loop over the lists, and the
re-ranked order against SR's tail (scores still falling with the rank)."""

import numpy as np
import pytest

from cfir_jax.retrieve.rerank_features import EntityEvidence, entity_features, feature_names
from cfir_jax.retrieve.reranker import rerank_order


def test_entity_features_equal_a_loop_over_the_lists():
    rng = np.random.default_rng(0)
    lists = [rng.permutation(50)[: rng.integers(5, 30)].astype(np.int32) for _ in range(4)]
    scores = [np.sort(rng.normal(size=len(lst)))[::-1].astype(np.float32) for lst in lists]
    rows = np.concatenate([rng.choice(np.concatenate(lists), 6, replace=False), [60, 61]])  # two in no list
    got = entity_features(rows, EntityEvidence(lists, scores, k=30))
    for i, row in enumerate(rows):
        held = [(list(lst).index(row), float(sc[list(lst).index(row)])) for lst, sc in zip(lists, scores) if row in lst]
        want = [len(held), len(held) / 4, np.log1p(min(p for p, _ in held)) / np.log1p(30) if held else 1.0,
                max(s for _, s in held) if held else 0.0]
        np.testing.assert_allclose(got[i], want, rtol=1e-6, err_msg=str(row))
    assert got[-1].tolist() == [0.0, 0.0, 1.0, 0.0]


def test_rerank_order_puts_the_top_n_by_logit_above_srs_tail():
    scores = np.array([0.9, 0.8, 0.7, 0.6, 0.5], np.float32)
    rows = np.array([10, 11, 12, 13, 14])
    s, r = rerank_order(scores, rows, np.array([-2.0, 3.0, 1.0], np.float32))
    assert r.tolist() == [11, 12, 10, 13, 14]
    assert np.all(np.diff(s) < 0) and s[2] == pytest.approx(0.6 + 1.0) and s[3:].tolist() == pytest.approx([0.6, 0.5])


def test_rerank_order_without_a_tail_keeps_the_logits():
    s, r = rerank_order(np.array([0.9, 0.8], np.float32), np.array([5, 6]), np.array([0.5, 2.0], np.float32))
    assert r.tolist() == [6, 5] and s.tolist() == [2.0, 0.5]


def test_rerank_order_ties_keep_srs_order():
    _, r = rerank_order(np.array([3.0, 2.0, 1.0], np.float32), np.array([7, 8, 9]), np.zeros(3, np.float32))
    assert r.tolist() == [7, 8, 9]


def test_the_image_text_features_come_last_and_only_with_image_text():
    assert feature_names(True)[: len(feature_names(False))] == feature_names(False)
    assert feature_names(True)[-2:] == ("txt", "has_txt") and "txt" not in feature_names(False)
