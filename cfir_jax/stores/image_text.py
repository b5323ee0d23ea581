"""The image-side text cache: what each cached image says about itself, embedded once by the frozen text tower.

Beyond the paper: AToMiC images carry their own text (reference description, alt text, attribution).
Embedding it with the frozen text tower gives a second vector per image, and SR can score a candidate by
`w_img * <q, image> + w_txt * <q, image text>` (`retrieval.fusion`; off by default, so the paper's numbers stay).

Layout of the store directory (kind "image_text"), rows in the image cache's row order:
  embeddings.npy  [N, D] float16, L2-normalised rows; all-zero rows for images without text (they add nothing)
  has_text.npy    [N] bool, False where the image has no text in the chosen fields (no embedding computed)
  manifest.json   format version, the text tower's fingerprint, the image cache build it follows, fields, dims,
                  counts, max_text_len
An image's text is its non-empty strings of `fields`, in field order, duplicates dropped, joined with spaces.

Building encodes the image cache's rows in chunks of `chunk_rows` into a work directory `.<name>.building/`
(`chunk-00000.npy` then `chunk-00000.json`, written last: it marks the chunk complete); an interrupted build of the
same key resumes after its finished chunks. Across the processes of a jax.distributed run chunk c is encoded by
process c % P (`hosts.owns`); process 0 merges the chunks inside an `atomic_dir` once all exist.

Readers (retrieval) take `ImageTextCache.open`; SR reads both caches as one matrix through
`cfir_jax.search.fused.FusedRows`. The builder imports no retrieval or training code.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cfir_jax.core.errors import StoreError
from cfir_jax.stores.contract import Store, check_manifest
from cfir_jax.stores.readers import Reader, register

KIND = "image_text"
FORMAT_VERSION = 1


class ImageTextCache(Store):
    """A complete image-text store opened for reading: `embeddings` [N, D] (memory-mapped), `has_text` [N] bool."""

    KIND, VERSION, STAGE = KIND, FORMAT_VERSION, "image_text"

    def __init__(self, path: Path, manifest: dict, embeddings: np.ndarray, has_text: np.ndarray):
        self.path, self.manifest, self.embeddings, self.has_text = path, manifest, embeddings, has_text

    @classmethod
    def check(cls, manifest: dict, path: Path, expect_fingerprint: str | None = None,
              expect_cache_fingerprint: str | None = None, **expect) -> None:
        """Refuses a store built by another text tower (`expect_fingerprint`), for another build of the image cache
        (`expect_cache_fingerprint`), or with other settings (`expect_<field>`): stale, rebuilt by its stage."""
        check_manifest(manifest, path, cls.STAGE, fingerprint=expect_fingerprint,
                       cache_fingerprint=expect_cache_fingerprint,
                       **{k.removeprefix("expect_"): v for k, v in expect.items()})

    @classmethod
    def load(cls, path: Path, manifest: dict) -> ImageTextCache:
        try:
            embeddings = np.load(path / "embeddings.npy", mmap_mode="r")
            has_text = np.load(path / "has_text.npy")
        except (OSError, ValueError) as e:
            raise StoreError(f"{path}: incomplete image text store ({e.__class__.__name__}); rebuild it") from None
        n, dim = manifest.get("num_rows"), manifest.get("dim")
        if embeddings.shape != (n, dim) or has_text.shape != (n,):
            raise StoreError(f"{path}: arrays {embeddings.shape}, {has_text.shape} disagree with the manifest "
                             f"({n}, {dim}); rebuild it with index.py --stages image_text")
        return cls(path, manifest, embeddings, has_text)

    @property
    def num_with_text(self) -> int:
        return int(self.manifest["num_with_text"])


def fusion_asked(config, method) -> bool:
    """SR fuses the image and image-text scores: a CFIR method with retrieval.fusion other than (w_img, w_txt) =
    (1, 0); or the method fuses them itself (cfir_text_convex)."""
    fusion = config.retrieval.fusion
    return method.cfir and (float(fusion.w_img), float(fusion.w_txt)) != (1.0, 0.0) or method.text_convex


# Retrieval opens it for fused SR, held to the index encoder's text tower and the image cache it was made from.
READER = register(Reader(KIND, ImageTextCache.open, asked=fusion_asked,
                         expect=lambda opened: {"expect_fingerprint": opened.encoder_fingerprint,
                                                "expect_cache_fingerprint": opened.cache.content_fingerprint}))
