"""The re-ranker's fit (cfir_jax/rerank/fit.py): a planted signal only the head can use lifts MRR@10 (and its shuffled
control does not), the MRR of a list, and the store it writes read back by retrieval to the same logits."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cfir_jax.core.errors import CfirError
from cfir_jax.model.rerank_head import RerankHead
from cfir_jax.rerank.fit import FitSettings, fit_head, list_mrr, save_reranker
from cfir_jax.retrieve.rerank_features import BASE_FEATURES
from cfir_jax.retrieve.reranker import Reranker


def _planted_lists(rng, lists: int, n: int = 20, shuffle_er: bool = False):
    """Lists in SR's order whose one positive sits anywhere (SR cannot see it) and is marked only by its share of the
    document's entity lists (er_frac): higher than the negatives' most of the time. shuffle_er: that column shuffled
    across the list's candidates (the control: the feature is there, its link to the positive is not)."""
    f = len(BASE_FEATURES)
    x = rng.normal(size=(lists, n, f)).astype(np.float32)
    x[..., 0] = -np.sort(-rng.normal(size=(lists, n)), axis=1)  # SR scores, best first
    positive = rng.integers(0, n, lists)
    labels = np.zeros((lists, n), bool)
    labels[np.arange(lists), positive] = True
    frac = rng.uniform(0.0, 0.6, (lists, n))
    frac[np.arange(lists), positive] = rng.uniform(0.4, 1.0, lists)
    if shuffle_er:
        frac = np.take_along_axis(frac, rng.permuted(np.tile(np.arange(n), (lists, 1)), axis=1), axis=1)
    x[..., BASE_FEATURES.index("er_frac")] = frac
    return x, np.ones((lists, n), bool), labels


@pytest.mark.parametrize("shuffle_er", [False, True], ids=["planted", "shuffled-control"])
def test_planted_entity_evidence_lifts_mrr_only_when_it_marks_the_positive(shuffle_er):
    rng = np.random.default_rng(3)
    x, valid, labels = _planted_lists(rng, 400, shuffle_er=shuffle_er)
    fit = fit_head(x, valid, labels, np.arange(300), np.arange(300, 400), FitSettings(max_epochs=60, patience=10))
    test_x, test_valid, test_labels = _planted_lists(rng, 300, shuffle_er=shuffle_er)  # unseen queries
    logits = np.asarray(fit.head(jnp.asarray(test_x), jnp.asarray(test_valid)))
    reranked = list_mrr(logits, test_valid, test_labels)
    sr = list_mrr(-np.arange(20.0)[None].repeat(300, 0), test_valid, test_labels)
    assert sr < 0.25  # the positive's SR rank is uniform over the list
    if shuffle_er:
        assert reranked < sr + 0.1, (reranked, sr)
    else:
        assert reranked > sr + 0.4, (reranked, sr)


def test_list_mrr_is_the_first_positives_reciprocal_rank_cut_at_10():
    logits = np.array([[3.0, 2.0, 1.0], [1.0, 2.0, 3.0], [0.0, 0.0, 0.0]], np.float32)
    labels = np.array([[False, True, False], [False, False, False], [False, False, True]])
    valid = np.array([[True, True, True], [True, True, True], [True, True, False]])  # the third's positive is padding
    assert list_mrr(logits, valid, labels) == pytest.approx((1 / 2 + 0 + 0) / 3)
    ranked_12th = np.zeros((1, 12), bool)
    ranked_12th[0, 11] = True
    assert list_mrr(-np.arange(12.0)[None], np.ones((1, 12), bool), ranked_12th) == 0.0


def test_fit_refuses_lists_without_a_held_out_share():
    x = np.zeros((2, 4, len(BASE_FEATURES)), np.float32)
    with pytest.raises(CfirError, match="needs at least one of each"):
        fit_head(x, np.ones((2, 4), bool), np.ones((2, 4), bool), np.arange(2), np.arange(0), FitSettings())


def test_a_saved_head_opens_for_retrieval_with_the_same_logits(tmp_path):
    features = BASE_FEATURES
    head = RerankHead(len(features), 8, rngs=nnx.Rngs(1))
    manifest = save_reranker(tmp_path / "reranker", head, features, top_n=6, max_text_len=64, li_top=8,
                             sources={"text_fingerprint": "text-0"}, sr_fusion=[1.0, 0.0])
    assert manifest["hidden"] == 8 and manifest["features"] == list(features)
    opened = Reranker.open(tmp_path / "reranker")
    x = np.random.default_rng(0).normal(size=(4, len(features))).astype(np.float32)
    padded, valid = np.zeros((1, 6, len(features)), np.float32), np.zeros((1, 6), bool)
    padded[0, :4], valid[0, :4] = x, True
    want = np.asarray(head(jnp.asarray(padded), jnp.asarray(valid)))[0, :4]
    np.testing.assert_allclose(opened.logits(x), want, rtol=1e-6)
