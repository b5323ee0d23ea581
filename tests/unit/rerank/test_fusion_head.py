"""The fusion fit scores each alpha on the head of each list (`fusion_fit.head`): the same MRR@10 as the whole lists,
ties at the tenth score included."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cfir_jax.eval import metrics
from cfir_jax.rerank.fusion_fit import head


def _run(lists, ids):
    return {f"q{q}": [(ids[int(r)], float(s)) for s, r in zip(*ranked)] for q, ranked in enumerate(lists)}


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 40), st.integers(1, 6))
def test_the_head_gives_the_whole_lists_mrr_at_10(seed, length, levels):
    rng = np.random.default_rng(seed)
    ids = [f"img{i}" for i in range(60)]
    lists, qrels = [], {}
    for q in range(8):
        rows = rng.choice(60, length, replace=False).astype(np.int32)
        scores = np.sort(rng.integers(0, levels, length).astype(np.float32))[::-1]  # few levels: many ties
        lists.append((scores, rows))
        qrels[f"q{q}"] = {ids[int(i)]: 1 for i in rng.choice(60, 3, replace=False)}
    heads = [head(ranked) for ranked in lists]
    assert all(len(h[0]) >= min(10, length) for h in heads)
    whole = metrics.evaluate(_run(lists, ids), qrels, measures=("mrr@10",), complete=True).aggregate["mrr@10"]
    cut = metrics.evaluate(_run(heads, ids), qrels, measures=("mrr@10",), complete=True).aggregate["mrr@10"]
    assert cut == whole


def test_the_head_keeps_every_hit_tied_with_the_tenth():
    scores = np.asarray([9, 8, 7, 6, 5, 4, 3, 2, 1, 1, 1, 0], np.float32)
    kept, rows = head((scores, np.arange(12, dtype=np.int32)))
    assert rows.tolist() == list(range(11))
