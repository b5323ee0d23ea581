"""The fitted convex fusions (beyond the paper): for each pair of scores the project fuses, the weight `alpha` of
`alpha * minmax(first) + (1 - alpha) * minmax(second)` that `retrieve.py --index W --fit-fusion` chose on the train
split (`cfir_jax.rerank.fusion_fit`), opened by `fitted` for a convex method with no weight configured:

- `bm25`: SR's list and BM25's (method `cfir_bm25_convex`, `cfir_jax.retrieve.lexical.convex`);
- `image_text`: the image's and the image's own text's scores over ER's union (method `cfir_text_convex`,
  `cfir_jax.retrieve.text_fusion`).

Layout of the store directory W/convex_fusion (kind "convex_fusion"): manifest.json alone. `pairs` holds, per pair
fitted, alpha, the split and documents it was fitted on and the train MRR@10 at each weight of the grid; the image
cache it was fitted over (cache_fingerprint). The top level also keeps bm25's alpha, split, documents and mrr10, as
the first stores held them before `pairs`, so an older store (bm25's alone) reads as one with that pair.
"""

from __future__ import annotations

from pathlib import Path

from cfir_jax.core.errors import CfirError
from cfir_jax.stores.contract import Store

KIND = "convex_fusion"
FORMAT_VERSION = 1
PAIRS = ("bm25", "image_text")  # what each pair fuses: the module docstring
_FIELDS = ("alpha", "split", "documents", "mrr10")  # what a pair's fit records


class FusionWeight(Store):
    """An opened fusion store: each fitted pair's weight (`pair(name)`); `alpha`: bm25's, SR's weight in [0, 1]."""

    KIND, VERSION, STAGE = KIND, FORMAT_VERSION, None

    def __init__(self, path: Path, manifest: dict, name: str = "bm25"):
        self.path, self.manifest, self.name = path, manifest, name

    def pair(self, name: str) -> dict | None:
        """The fit of pair `name` (alpha, split, documents, mrr10), or None when this store holds none."""
        pairs = self.manifest.get("pairs")
        if pairs is None:  # a store written before `pairs`: bm25's fit alone, at the top level
            return {k: self.manifest[k] for k in _FIELDS} if name == "bm25" and "alpha" in self.manifest else None
        return pairs.get(name)

    def pairs(self) -> dict[str, dict]:
        """Every fitted pair's fit, in PAIRS' order."""
        return {name: fit for name in PAIRS if (fit := self.pair(name)) is not None}

    def of(self, name: str) -> FusionWeight:
        """This store as pair `name`'s weight (`alpha`, `split`)."""
        return FusionWeight(self.path, self.manifest, name)

    @property
    def alpha(self) -> float:
        return float(self.pair(self.name)["alpha"])

    @property
    def split(self) -> str:
        return str(self.pair(self.name)["split"])

    @classmethod
    def load(cls, path: Path, manifest: dict) -> FusionWeight:
        return cls(path, manifest)


def pair_of(method) -> str:
    """The pair a convex method fuses ('' for any other method)."""
    return "bm25" if method.convex else "image_text" if getattr(method, "text_convex", False) else ""


def configured_alpha(rcfg, pair: str) -> float:
    """The weight the config sets for `pair` (-1: the fitted one)."""
    return float(rcfg.lexical.alpha if pair == "bm25" else rcfg.fusion.alpha)


def fitted(layout, method, rcfg) -> FusionWeight | None:
    """The fitted weight of the pair a convex method fuses, when the config sets none (its alpha < 0); None
    otherwise. Not fitted yet, or fitted for other pairs only: one line saying how to fit it."""
    pair = pair_of(method)
    if not pair or configured_alpha(rcfg, pair) >= 0:
        return None
    key = "retrieval.lexical.alpha" if pair == "bm25" else "retrieval.fusion.alpha"
    how = f"fit it with retrieve.py --index {layout.root} --fit-fusion, or set --config.{key}"
    if not (layout.convex_fusion / "manifest.json").is_file():
        raise CfirError(f"{layout.convex_fusion}: the convex fusion's weight is not fitted; {how}")
    store = FusionWeight.open(layout.convex_fusion)
    if store.pair(pair) is None:
        raise CfirError(f"{layout.convex_fusion}: holds no weight for the {pair} pair (fitted before it was fused "
                        f"convexly, or without W/{'lexical' if pair == 'bm25' else 'image_text'}); {how}")
    return store.of(pair)
