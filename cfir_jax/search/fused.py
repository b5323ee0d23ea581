"""The fused [image, image text] view: SR by w_img * <q, image> + w_txt * <q, image text> through any exact scorer.

Beyond the paper (`retrieval.fusion`): the image cache [N, D] and the image-text store [N, D]
(`cfir_jax.stores.image_text`) read as one [N, 2D] matrix, scored against the query [w_img q, w_txt q], so the CPU
scorers, the device-resident cache and the whole-cache search serve fusion unchanged. Nothing [N, 2D] is ever
materialised on the host: rows are gathered on demand.
"""

from __future__ import annotations

import numpy as np

from cfir_jax.core.errors import CfirError


class FusedRows:
    """A read-only [N, D_img + D_txt] view whose row r is [images[r], texts[r]], gathered on demand.

    With the query [w_img * q, w_txt * q] (`fused_queries`), a plain dot product with a row is the fused score
    w_img * <q, image> + w_txt * <q, image text>, so every exact scorer (numpy gathers, the device cache, the
    blocked full search) serves fusion unchanged; with [e, 0] it is the image score alone.
    """

    def __init__(self, images: np.ndarray, texts: np.ndarray):
        if images.shape[0] != texts.shape[0]:
            raise CfirError(f"image text store has {texts.shape[0]} rows but the image cache {images.shape[0]}")
        self.images, self.texts = images, texts
        self.shape = (images.shape[0], images.shape[1] + texts.shape[1])
        self.dtype = np.result_type(images.dtype, texts.dtype)
        self.ndim = 2

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows) -> np.ndarray:
        """rows: an integer array or a slice -> [len(rows), D_img + D_txt]."""
        return np.concatenate([np.asarray(self.images[rows], self.dtype), np.asarray(self.texts[rows], self.dtype)],
                              axis=-1)

    def take_rows(self, rows: np.ndarray, out: np.ndarray) -> None:
        """Gathers rows [m] into out [m, D_img + D_txt] without a temporary (the fast SR scorer's exact pass)."""
        d = self.images.shape[1]
        np.take(self.images, rows, axis=0, out=out[:, :d], mode="clip")
        np.take(self.texts, rows, axis=0, out=out[:, d:], mode="clip")


def fused_queries(queries: np.ndarray, w_img: float, w_txt: float) -> np.ndarray:
    """queries [Q, D] -> [Q, 2D] float32: [w_img * q, w_txt * q] (the query side of `FusedRows`)."""
    queries = np.asarray(queries, np.float32)
    return np.concatenate([np.float32(w_img) * queries, np.float32(w_txt) * queries], axis=-1)
