"""The entity candidate index: for every entity text, its top-K images by dot product (CFIR's ER stage).

Layout of the store directory (kind "entity_index", format 2: ragged, compressed sparse rows):
  offsets.npy     int64 [E + 1]   entity i's candidates are candidates[offsets[i]:offsets[i + 1]] (at most K)
  candidates.npy  int32 [M]       image rows of the cache, best first per entity (memory-mappable)
  scores.npy      float16 [M]     their dot products (optional)
  vocab.json      [E] entity surface forms (what was encoded); row i belongs to vocab[i], looked up by `entity_key`
  entity_embeddings.npy  float32 [E, D] the encoded entities (manifest `has_embeddings`; absent in older indexes),
                  so adding images scores each entity without the encoder
  scann/          the serialized ScaNN searcher over the image cache rows [0, searcher_rows), for entities unseen at
                  index time (optional; rows appended since are searched exactly: `search.knn.search_with_tail`)
  manifest.json   format version, model fingerprint, dim, K, backend, counts, recall@K measured against exact search;
                  n_images (rows of the cache), n_live (rows searched: not removed), searcher_rows, chunk_size

Rows are ragged because ScaNN can find fewer than K neighbours (the searched leaves hold fewer points): an entity
then has a shorter list, and no padding id is ever stored or returned. Format 1 (a padded [E, K] matrix that could
hold -1) is refused with a one-line error asking for a rebuild.

Built by `cfir_jax.builders.entity_index_build` (later stages import this reader only, never the builder).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from cfir_jax.core.errors import CfirError, StoreError
from cfir_jax.stores.contract import Store
from cfir_jax.stores.entities import entity_key
from cfir_jax.stores.integrity import check_csr

KIND = "entity_index"
VERSION = 2


@dataclasses.dataclass
class EntityIndex(Store):
    """An opened entity index: CSR offsets [E + 1] int64, memory-mapped candidates [M] int32 (and scores [M] f16)."""

    KIND, VERSION = KIND, VERSION

    directory: Path
    manifest: dict
    vocab: list[str]
    offsets: np.ndarray
    candidates_array: np.ndarray
    scores_array: np.ndarray | None
    _rows: dict[str, int] | None = None
    # A query-time cut (retrieval.k): each list read up to its first `cut` candidates. Lists are stored best first,
    # so an index built at K holds the index of every K' <= K (exactly so on the exact backend).
    cut: int | None = None

    @classmethod
    def check(cls, manifest: dict, directory: Path, expect_fingerprint: str | None = None,
              expect_dim: int | None = None, expect_n_images: int | None = None) -> None:
        """Refuses an index built by another text tower, of another dim or over another number of images."""
        super().check(manifest, directory, model_fingerprint=expect_fingerprint, dim=expect_dim,
                      n_images=expect_n_images)

    @classmethod
    def load(cls, directory: Path, manifest: dict) -> EntityIndex:
        try:
            vocab = json.loads((directory / "vocab.json").read_text(encoding="utf-8"))
            offsets = np.load(directory / "offsets.npy")
            cand = np.load(directory / "candidates.npy", mmap_mode="r")
            scores = np.load(directory / "scores.npy", mmap_mode="r") if manifest.get("has_scores") else None
        except (OSError, ValueError) as e:
            raise StoreError(f"{directory}: damaged entity index ({e.__class__.__name__}: {e}); rebuild it") from None
        e, m = manifest["n_entities"], manifest["n_candidates"]
        lengths = np.diff(offsets)
        if offsets.shape != (e + 1,) or len(vocab) != e or cand.shape != (m,) or offsets[-1] != m or \
                (scores is not None and scores.shape != (m,)) or lengths.min(initial=0) < 0 or \
                lengths.max(initial=0) > manifest["k"]:
            raise StoreError(
                f"{directory}: offsets {offsets.shape} / candidates {cand.shape} / vocab {len(vocab)} disagree with "
                f"the manifest ({e} entities, {m} candidates, K={manifest['k']}); rebuild it"
            )
        check_csr(offsets, cand, manifest.get("n_images"), directory)
        return cls(directory, manifest, vocab, offsets, cand, scores)

    @property
    def built_k(self) -> int:
        """The K the index was built with."""
        return int(self.manifest["k"])

    @property
    def k(self) -> int:
        """Candidates per entity as read: the cut when one is set, else the built K."""
        return self.cut if self.cut is not None else self.built_k

    def with_k(self, k: int | None) -> EntityIndex:
        """This index read at K = `k` (None or 0: as built); above the built K is refused in one line."""
        if not k:
            return dataclasses.replace(self, cut=None)
        if k < 0 or k > self.built_k:
            raise CfirError(f"retrieval.k={k}: the entity index at {self.directory} was built with K={self.built_k}; "
                            f"a cut can only shrink it (rebuild with --config.index.entity_index.k={k} for more)")
        return dataclasses.replace(self, cut=int(k))

    def __len__(self) -> int:
        return len(self.vocab)

    def row(self, entity_text: str) -> int | None:
        """The row of an entity text (matched by `entity_key`: case and whitespace aside), or None if not indexed."""
        if self._rows is None:
            self._rows = {entity_key(t): i for i, t in enumerate(self.vocab)}
        return self._rows.get(entity_key(entity_text))

    @property
    def lengths(self) -> np.ndarray:
        """Number of candidates of every entity: int64 [E], each <= K."""
        lengths = np.diff(self.offsets)
        return lengths if self.cut is None else np.minimum(lengths, self.cut)

    def _checked_rows(self, entity_rows: Sequence[int] | np.ndarray) -> np.ndarray:
        rows = np.asarray(entity_rows, dtype=np.int64).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= len(self.vocab)):
            raise CfirError(f"entity rows must be in [0, {len(self.vocab)}); got {rows.min()}..{rows.max()}")
        return rows

    def candidates(self, entity_rows: Sequence[int] | np.ndarray) -> list[np.ndarray]:
        """Candidate image rows of entity_rows [R] -> R arrays int32 [k_i <= K] (rows of the cache, best first)."""
        return [np.asarray(self.candidates_array[self.offsets[r] : self._end(r)], np.int32)
                for r in self._checked_rows(entity_rows)]

    def scores(self, entity_rows: Sequence[int] | np.ndarray) -> list[np.ndarray]:
        """Stored scores of entity_rows [R] -> R arrays float32 [k_i]; StoreError if the index kept none."""
        if self.scores_array is None:
            raise StoreError(f"{self.directory}: built with keep_scores=False; rebuild with scores to read them")
        return [np.asarray(self.scores_array[self.offsets[r] : self._end(r)], np.float32)
                for r in self._checked_rows(entity_rows)]

    def er_note(self) -> str:
        """One line on how exact ER is: exact (the paper's), or ScaNN with its recall measured at build and the flag
        that rebuilds it exact."""
        m = self.manifest
        cut = f", read at K={self.k:,} (retrieval.k)" if self.cut is not None else ""
        if m.get("backend") == "exact":
            return f"ER: exact top-{self.built_k:,} per entity (the paper's){cut}"
        recall = m.get("recall_at_k")
        measured = (f"recall@{self.built_k:,} {recall:.4f} against exact search on {m.get('recall_sample', 0):,} "
                    "sampled entities") if recall is not None else "recall not measured"
        return (f"ER: ScaNN top-{self.built_k:,} per entity, {measured}{cut}; the paper's ER is exact: rebuild with "
                "index.py --config.index.entity_index.backend=exact")

    def _end(self, r: int) -> int:
        end = int(self.offsets[r + 1])
        return end if self.cut is None else min(end, int(self.offsets[r]) + self.cut)

    @property
    def has_embeddings(self) -> bool:
        return bool(self.manifest.get("has_embeddings"))

    def entity_embeddings(self) -> np.ndarray:
        """The encoded entities, float32 [E, D] memory-mapped; StoreError for an index built before they were kept."""
        if not self.has_embeddings:
            raise StoreError(f"{self.directory}: built without entity_embeddings.npy; re-encode the entities")
        try:
            emb = np.load(self.directory / "entity_embeddings.npy", mmap_mode="r")
        except (OSError, ValueError) as e:
            raise StoreError(f"{self.directory}: damaged entity_embeddings.npy ({e.__class__.__name__}); rebuild it") \
                from None
        if emb.shape != (len(self.vocab), self.manifest["dim"]) or emb.dtype != np.float32:
            raise StoreError(f"{self.directory}: entity_embeddings.npy is {emb.dtype} {emb.shape} but the manifest "
                             f"says float32 [{len(self.vocab)}, {self.manifest['dim']}]; rebuild it")
        return emb

    @property
    def searcher_rows(self) -> int:
        """Image rows [0, searcher_rows) the stored ScaNN tree covers (rows added since are searched exactly)."""
        return int(self.manifest.get("searcher_rows", self.manifest.get("n_images", 0)))

    def searcher_dir(self) -> Path:
        """Where the stored ScaNN searcher over the image cache is (for entities unseen at index time; loaded with
        `cfir_jax.search.knn.ScannSearcher.load`)."""
        if not self.manifest.get("has_searcher"):
            raise StoreError(f"{self.directory}: no ScaNN searcher stored; build with backend='scann'")
        return self.directory / "scann"
