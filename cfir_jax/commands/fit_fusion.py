"""The fit-fusion command (`retrieve.py --index W --fit-fusion`): fits the convex fusions' weights (SR and BM25; the
image and its own text) on the train split into W/convex_fusion (`cfir_jax.rerank.fusion_fit`) and says what the fit
found, one line per pair."""

from __future__ import annotations

import ml_collections

from cfir_jax.rerank.fusion_fit import fit_fusion, summary


def run(config: ml_collections.ConfigDict, workdir) -> dict:
    """Fits and writes W/convex_fusion; prints the summary and returns the store's manifest."""
    manifest = fit_fusion(config, workdir)
    print(summary(manifest, workdir))
    return manifest
