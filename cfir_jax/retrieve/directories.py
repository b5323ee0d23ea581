"""The stores the Retriever derives when it opens the index (`cfir_jax.retrieve.sr`), declared once beside it:
made again whenever missing or made from another cache, so the index's fingerprint leaves them out. A change of the
collection extends or remaps them all the same (`cfir_jax.builders.sr_compact_update`). Light (no JAX)."""

from __future__ import annotations

from cfir_jax.stores.layout import DERIVED, Directory, declare

declare(Directory("sr_compact", DERIVED, made_from=("image_cache",),
                  about="a compact copy of the cache for SR's two-pass scoring (cfir_jax.search.compact)"))
declare(Directory("sr_compact_fused", DERIVED, made_from=("image_cache", "image_text"),
                  about="the same for fused SR: a compact copy of the rows [image, image text]"))
