"""The fitted convex fusion (beyond the paper): the weight `alpha` of `alpha * minmax(SR) + (1 - alpha) *
minmax(BM25)` that `retrieve.py --index W --fit-fusion` chose on the train split (`cfir_jax.rerank.fusion_fit`), read by
the method `cfir_bm25_convex` (`cfir_jax.retrieve.lexical.convex`), opened by `fitted` when no weight is configured.

Layout of the store directory W/convex_fusion (kind "convex_fusion"): manifest.json alone: alpha, the split and
documents it was fitted on, the train MRR@10 at each weight of the grid, the image cache it was fitted over
(cache_fingerprint).
"""

from __future__ import annotations

from pathlib import Path

from cfir_jax.core.errors import CfirError
from cfir_jax.stores.contract import Store

KIND = "convex_fusion"
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


def fitted(layout, method, rcfg) -> FusionWeight | None:
    """The fitted weight, for the convex method with no alpha set in the config (retrieval.lexical.alpha < 0); None
    otherwise. Not fitted yet: one line saying how to fit it."""
    if not method.convex or float(rcfg.lexical.alpha) >= 0:
        return None
    if not (layout.convex_fusion / "manifest.json").is_file():
        raise CfirError(f"{layout.convex_fusion}: the convex fusion's weight is not fitted; fit it with retrieve.py "
                        f"--index {layout.root} --fit-fusion, or set --config.retrieval.lexical.alpha")
    return FusionWeight.open(layout.convex_fusion)
