"""Removed images (index.py --remove) are never drawn as negatives; with nothing removed the draws are unchanged."""

import dataclasses

import numpy as np
from train_fixtures import planted_data


def test_random_and_hard_negatives_skip_removed_rows_and_are_unchanged_without_removals():
    data = planted_data(with_eval=False)
    live = np.arange(0, data.image_embeddings.shape[0], 3)  # two thirds removed
    pruned = dataclasses.replace(data, live_rows=live)
    removed = np.setdiff1d(np.arange(len(data.image_embeddings)), live)
    rows = data.batch_rows(0, 8, seed=0)
    for kind in ("random", "hard"):
        picked = pruned.negatives(0, rows, 40, kind, seed=0)
        assert not any(np.allclose(p, data.image_embeddings[r]) for p in picked for r in removed)
    drawn = np.random.default_rng([0, 3, 7]).integers(0, len(data.image_embeddings), 16)  # the draw before removals
    np.testing.assert_array_equal(data.negatives(3, rows, 16, "random", seed=0), data.image_embeddings[np.sort(drawn)])
