"""BM25 at query time: reciprocal-rank fusion against a hand count, and the sweeps --compare-k runs over M and the
fusion weight."""

import numpy as np
import pytest

from cfir_jax.eval.comparison import LEXICAL, k_rows, parse_ks, parse_weights
from cfir_jax.retrieve.lexical import rrf


def _ranked(rows):
    return np.linspace(1, 0, len(rows)).astype(np.float32), np.asarray(rows, np.int32)


def test_rrf_sums_reciprocal_ranks_of_both_lists():
    sr, bm25 = _ranked([5, 7, 9]), _ranked([9, 3])
    scores, rows = rrf(sr, bm25, weight=2.0, rrf_k=60, k=10)
    want = {5: 1 / 61, 7: 1 / 62, 9: 1 / 63 + 2 / 61, 3: 2 / 62}
    assert list(rows) == sorted(want, key=lambda r: (-want[r], r))
    np.testing.assert_allclose(scores, [want[r] for r in rows], rtol=1e-6)


def test_rrf_weight_zero_keeps_the_sr_order_and_padding_is_ignored():
    sr, bm25 = _ranked([4, 2, 8]), (np.array([3.0, -np.inf], np.float32), np.array([1, -1], np.int32))
    _, rows = rrf(sr, bm25, weight=0.0, rrf_k=60, k=3)
    assert list(rows) == [4, 2, 8]
    _, rows = rrf(sr, bm25, weight=1.0, rrf_k=60, k=10)
    assert -1 not in rows and set(rows) == {1, 2, 4, 8}


def test_compare_k_sweeps_m_and_the_fusion_weight():
    rows = k_rows((100, 0, 10), "cfir_bm25")
    assert [r.overrides["retrieval.lexical.candidates"] for r in rows] == [0, 10, 100]
    assert {r.method for r in rows} == {"cfir_bm25"}
    rows = k_rows(parse_weights("2,0.5"), "cfir_bm25_fused")
    assert [r.overrides["retrieval.lexical.fuse_weight"] for r in rows] == [0.5, 2.0]
    assert parse_ks("0,10", minimum=0) == (0, 10)
    with pytest.raises(ValueError, match="positive integers"):
        parse_ks("0,10")
    with pytest.raises(ValueError, match="weights"):
        parse_weights("-1")
    assert [r.method for r in LEXICAL] == ["bm25", "cfir_bm25", "cfir_bm25_fused"]
