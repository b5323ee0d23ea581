"""The fit-reranker command (`retrieve.py --index W --fit-reranker`): fits the third stage's re-ranker on the train
split's SR lists into W/reranker (`cfir_jax.rerank.fit`) and says what the fit did in three lines."""

from __future__ import annotations

import ml_collections

from cfir_jax.rerank.fit import fit_reranker, summary


def run(config: ml_collections.ConfigDict, workdir) -> dict:
    """Fits and writes W/reranker; prints the summary and returns the store's manifest."""
    manifest = fit_reranker(config, workdir)
    print(summary(manifest, workdir))
    return manifest
