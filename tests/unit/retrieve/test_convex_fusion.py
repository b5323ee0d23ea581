"""The convex fusion of SR and BM25: alpha * minmax(SR) + (1 - alpha) * minmax(BM25) over the rows of both lists,
each list scaled to [0, 1], a row one list lacks scoring 0 there."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cfir_jax.core.config import retrieval_config
from cfir_jax.core.errors import CfirError
from cfir_jax.retrieve.lexical import LexicalSearch, convex, minmax

QUICK = settings(max_examples=100, deadline=None, database=None)


def _ranked(pairs):
    return np.array([s for s, _ in pairs], np.float32), np.array([r for _, r in pairs], np.int32)


def test_the_fused_score_is_the_convex_combination_written_out():
    sr = _ranked([(0.9, 3), (0.5, 1), (0.1, 7)])
    bm25 = _ranked([(12.0, 1), (6.0, 5), (2.0, 3)])
    scores, rows = convex(sr, bm25, 0.25, 10)
    # minmax: SR 3 -> 1, 1 -> 0.5, 7 -> 0; BM25 1 -> 1, 5 -> 0.4, 3 -> 0
    expected = {1: 0.25 * 0.5 + 0.75 * 1.0, 3: 0.25 * 1.0, 5: 0.75 * 0.4, 7: 0.0}
    assert rows.tolist() == sorted(expected, key=lambda r: (-expected[r], r))
    assert np.allclose(scores, [expected[r] for r in rows.tolist()])
    assert convex(sr, bm25, 0.25, 2)[1].tolist() == rows[:2].tolist()


def test_padding_rows_are_ignored_and_equal_scores_scale_to_one():
    sr = _ranked([(0.4, 2), (-np.inf, -1)])
    assert minmax(np.array([3.0, 3.0])).tolist() == [1.0, 1.0]
    scores, rows = convex(sr, _ranked([]), 0.5, 5)
    assert rows.tolist() == [2] and scores.tolist() == [0.5]


@QUICK
@given(st.lists(st.integers(-1000, 1000), min_size=1, max_size=20, unique=True),
       st.lists(st.integers(0, 3000), min_size=1, max_size=20, unique=True))
def test_alpha_one_keeps_srs_order_and_zero_bm25s(a, b):
    a, b = [x / 1000 for x in a], [x / 100 for x in b]  # distinct in float32
    sr = _ranked(sorted(zip(a, range(len(a))), reverse=True))
    bm25 = _ranked(sorted(zip(b, range(100, 100 + len(b))), reverse=True))
    top_sr = convex(sr, bm25, 1.0, len(a) + len(b))[1].tolist()
    top_bm25 = convex(sr, bm25, 0.0, len(a) + len(b))[1].tolist()
    # Ties at 0 (each list's last row and the other list's rows) go to the lower row.
    assert top_sr[: len(a) - 1] == sr[1].tolist()[: len(a) - 1]
    assert top_bm25[: len(b) - 1] == bm25[1].tolist()[: len(b) - 1]


@pytest.mark.parametrize("alpha", [-0.5, 1.5])
def test_an_alpha_out_of_range_is_one_line(alpha):
    rcfg = retrieval_config()
    rcfg.lexical.alpha = alpha
    with pytest.raises(CfirError, match=r"retrieval.lexical.alpha=.*in \[0, 1\]"):
        LexicalSearch(rcfg, None, None)
