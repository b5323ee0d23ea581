"""Beyond the paper: entities matched against what images say about themselves (off by default).

CFIR's ER finds an entity's images only through the embedding space: the entity text's top-K images by dot
product. An image whose own text (AToMiC's reference, alt-text and attribution captions) names the entity is direct
evidence that the embedding may miss, most of all for rare names the frozen encoder has never seen. This store lists,
for every entity of the entity index, the cache rows whose image text contains the entity's name as whole words
(case-folded, so "The Hague" matches "the hague, 1890" but "Hague" does not match "Hagueville"); retrieval adds them
to that entity's candidate list (`retrieval.entity_text_match`). A name mentioned by more than `max_matches` images
says little about any one of them ("London" in a million attributions): it is left out (counted in the manifest).

Layout of the store (kind "entity_text_match", format 1), aligned with the entity index's rows:
  offsets.npy   int64 [E + 1]   entity i's images are rows[offsets[i]:offsets[i + 1]], ascending
  rows.npy      int32 [M]       image cache rows
  manifest.json the entity index and image cache builds it follows, the fields, max_matches, counts

Matching is one pass over the image texts: every run of up to `max_words` consecutive words is looked up in a hash
map of the entity names (names are short; longer ones never match), so the cost is linear in the text, not in the
number of entities. Image rows are cut into chunks; under jax.distributed process p matches the chunks c with
c % P == p (`cfir_jax.core.hosts`) into `.<name>.building/chunk-*.npz`, a finished chunk is never redone (a killed run
resumes), and process 0 commits the store once every chunk exists.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from cfir_jax.core.errors import StoreError
from cfir_jax.stores.contract import Store, manifest_digest
from cfir_jax.stores.integrity import check_csr
from cfir_jax.stores.readers import Reader, register

KIND = "entity_text_match"
FORMAT_VERSION = 1










class EntityTextMatch(Store):
    """The complete store opened for reading: `rows_of(entity_rows)` -> the matched image rows of each entity."""

    KIND, VERSION, STAGE = KIND, FORMAT_VERSION, "entity_text_match"

    def __init__(self, path: Path, manifest: dict, offsets: np.ndarray, rows: np.ndarray):
        self.path, self.manifest, self.offsets, self.rows = path, manifest, offsets, rows

    @classmethod
    def load(cls, path: Path, manifest: dict) -> EntityTextMatch:
        try:
            offsets = np.load(path / "offsets.npy")
            rows = np.load(path / "rows.npy", mmap_mode="r")
        except (OSError, ValueError) as e:
            raise StoreError(f"{path}: unreadable ({e.__class__.__name__}); rebuild it with index.py") from None
        if len(offsets) != manifest["num_entities"] + 1 or offsets[-1] != len(rows):
            raise StoreError(f"{path}: offsets and rows disagree with the manifest; rebuild it with index.py")
        check_csr(offsets, rows, None, path)
        return cls(path, manifest, offsets, rows)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def rows_of(self, entity_rows: Sequence[int] | np.ndarray) -> list[np.ndarray]:
        """int32 [m_i] ascending image rows per entity row (empty when nothing matched)."""
        return [np.asarray(self.rows[self.offsets[e] : self.offsets[e + 1]]) for e in entity_rows]


# Retrieval opens it for CFIR with retrieval.entity_text_match, held to the entity index and image cache it follows.
READER = register(Reader(
    KIND, EntityTextMatch.open, asked=lambda config, method: method.cfir and bool(config.retrieval.entity_text_match),
    expect=lambda opened: {"entity_index": manifest_digest(opened.entity_index.manifest),
                           "cache_fingerprint": opened.cache.content_fingerprint}))
