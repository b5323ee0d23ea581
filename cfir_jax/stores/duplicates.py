"""Near-duplicate images as groups, one label per image cache row: what a search folds (docs/duplicates.md).

Layout of the store directory (kind "duplicates"), rows in the image cache's row order:
  edges.npy       int32 [E, 2]: the pairs (i < j) of rows whose embeddings' cosine is at least the threshold, as the
                  neighbour search found them (removed rows included: a removal or a compaction regroups from them)
  group.npy       int32 [N]: each live row's group, named by its smallest live row (an image alone is its own
                  group: group[r] == r); -1 for a removed row
  manifest.json   format version, threshold, neighbours, num_rows, num_edges, num_groups (of two or more images),
                  num_folded (images a search can fold under another), the image cache build it follows
                  (cache_fingerprint), its ids (ids_sha) and its removals (removed_sha)

A group is a connected component of the threshold graph over the live images (`cfir_jax.builders.duplicates`
builds it and follows each change of the collection).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cfir_jax.core.errors import StoreError
from cfir_jax.stores.contract import Store

KIND = "duplicates"
FORMAT_VERSION = 1
REBUILD = "rebuild it with index.py --stages duplicates"


class Duplicates(Store):
    """An opened duplicates store: `group` int32 [N] (each row's group label, -1 removed), `edges` int32 [E, 2]."""

    KIND, VERSION, STAGE = KIND, FORMAT_VERSION, "duplicates"

    def __init__(self, path: Path, manifest: dict, group: np.ndarray, edges: np.ndarray):
        self.path, self.manifest, self.group, self.edges = path, manifest, group, edges

    @property
    def num_rows(self) -> int:
        return int(self.manifest["num_rows"])

    @property
    def threshold(self) -> float:
        return float(self.manifest["threshold"])

    def follows(self, cache) -> bool:
        """Whether it was made for this image cache's rows and removals (else a search does not fold with it)."""
        m = self.manifest
        return m.get("cache_fingerprint") == cache.content_fingerprint and m.get("num_rows") == cache.num_images \
            and m.get("removed_sha") == cache.manifest.get("removed_sha")

    def members(self, row: int) -> np.ndarray:
        """The live rows of `row`'s group, ascending (the row alone when it has no near-duplicate)."""
        label = self.group[row]
        return np.flatnonzero(self.group == label) if label >= 0 else np.zeros(0, np.int64)

    @classmethod
    def load(cls, path: Path, manifest: dict) -> Duplicates:
        n, e = manifest.get("num_rows"), manifest.get("num_edges")
        try:
            group, edges = np.load(path / "group.npy"), np.load(path / "edges.npy")
        except (OSError, ValueError) as err:
            raise StoreError(f"{path}: incomplete duplicates store ({err.__class__.__name__}); {REBUILD}") from None
        if group.shape != (n,) or group.dtype != np.int32 or edges.shape != (e, 2) or edges.dtype != np.int32:
            raise StoreError(f"{path}: group {group.dtype} {group.shape}, edges {edges.dtype} {edges.shape}; the "
                             f"manifest says ({n},) and ({e}, 2) int32; {REBUILD}")
        rows = np.arange(n)
        live = group >= 0
        # A label is its group's smallest row, itself labelled so: an impossible label is a damaged store.
        if np.any(group >= n) or np.any(group < -1) or np.any(group[live] > rows[live]) \
                or np.any(group[group[live]] != group[live]):
            raise StoreError(f"{path / 'group.npy'}: labels that name no group's smallest row; {REBUILD}")
        return cls(path, manifest, group, edges)
