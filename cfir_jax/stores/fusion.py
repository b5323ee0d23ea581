"""The fitted convex fusion (beyond the paper): the weight `alpha` of `alpha * minmax(SR) + (1 - alpha) *
minmax(BM25)` that `retrieve.py --index W --fit-fusion` chose on the train split (`cfir_jax.rerank.fusion_fit`), read by
the method `cfir_bm25_convex` (`cfir_jax.retrieve.lexical.convex`).

Layout of the store directory (kind "fusion"): manifest.json alone: alpha, the split and documents it was fitted on,
the train MRR@10 at each weight of the grid, the lexical store it was fitted with (cache_fingerprint).
"""

from __future__ import annotations

from pathlib import Path

from cfir_jax.stores.contract import Store
from cfir_jax.stores.readers import Reader, register

KIND = "fusion"
FORMAT_VERSION = 1


class FusionWeight(Store):
    """An opened fusion store: `alpha`, SR's weight in [0, 1]."""

    KIND, VERSION, STAGE = KIND, FORMAT_VERSION, None

    def __init__(self, path: Path, manifest: dict):
        self.path, self.manifest = path, manifest

    @property
    def alpha(self) -> float:
        return float(self.manifest["alpha"])

    @classmethod
    def load(cls, path: Path, manifest: dict) -> FusionWeight:
        return cls(path, manifest)


def fitted_alpha_asked(config, method) -> bool:
    """The convex method with no alpha set in the config (retrieval.lexical.alpha < 0) reads the fitted one."""
    return method.convex and float(config.retrieval.lexical.alpha) < 0


READER = register(Reader(KIND, FusionWeight.open, asked=fitted_alpha_asked))
