"""The convex fusion of the image and its own text (beyond the paper, method `cfir_text_convex`): ER's union ranked by
`alpha * minmax(<q, image>) + (1 - alpha) * minmax(<q, image text>)`, both scored exactly over the whole union
(`cfir_jax.search.topk.exact_scores`) and min-max normalised over it (`cfir_jax.retrieve.lexical.convex`, the one
convex combination). alpha is retrieval.fusion.alpha, or the one `retrieve.py --fit-fusion` fitted on the train
split into W/convex_fusion (pair `image_text`, `cfir_jax.stores.convex_fusion`).

Beside `retrieval.fusion`'s fused SR (`w_img * <q, image> + w_txt * <q, image text>`, raw scores, one dot product per
candidate), which stays a choice: the normalisation is per query, so each query weighs its two scores by their
ranges over its own union, which one fused dot product cannot do. Both scores are computed on the host, over the
union only; a document without a usable entity falls back to CFIR's whole-cache search with the image alone.
"""

from __future__ import annotations

import numpy as np

from cfir_jax.retrieve.entity_ranking import union_of
from cfir_jax.retrieve.lexical import convex
from cfir_jax.search.topk import exact_scores

Ranked = tuple[np.ndarray, np.ndarray]


class TextConvex:
    """Ranks a union by the convex fusion of its image and image-text scores.

    images, texts: the image cache [N, D] and the image-text store's embeddings [N, D]; alpha: the image's weight.
    `kept`: when a list, each ranked union's (rows [M], image scores [M], text scores [M]) is appended to it (the fit
    sweeps alpha over them without scoring again).
    """

    def __init__(self, images: np.ndarray, texts: np.ndarray, alpha: float):
        self.images, self.texts, self.alpha = images, texts, float(alpha)
        self.kept: list | None = None

    def rank(self, query: np.ndarray, lists: list[np.ndarray], k: int) -> Ranked:
        """query [D], ER's candidate lists -> (scores [k'], rows [k']) best first, k' = min(k, union)."""
        union = union_of(lists)
        img = exact_scores(self.images, query, union)
        txt = exact_scores(self.texts, query, union)
        if self.kept is not None:
            self.kept.append((union, img, txt))
        return fuse(union, img, txt, self.alpha, k)


def fuse(union: np.ndarray, img: np.ndarray, txt: np.ndarray, alpha: float, k: int) -> Ranked:
    """The convex fusion of the scores img [M] and txt [M] of rows union [M]: top k."""
    return convex((img, union), (txt, union), alpha, k)
