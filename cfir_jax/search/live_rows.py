"""The rows a query may return: every image cache row but the removed ones (`index.py --remove`), in one place.

A removal moves no row (the cache keeps its [N, D] embeddings until `index.py --compact`); it only marks rows
removed (`ImageCache.removed`, bool [N]). Retrieval honours the mask at two kinds of places, both through this
object, built once when the stores open:

- where candidates are formed (entity lists, text matches, the union): `keep` drops removed rows, order kept;
- where a whole-cache search comes back (the dense baselines, CFIR's no-entity fallback, unseen entities searched at
  query time, exact or ScaNN): with few rows removed (R <= k), the search is asked for k + R rows (`fetch`) and
  `top` keeps each query's first k live ones. At most R of the k + R best are removed, so the top k stays exact,
  and the search programs stay as they are. With more removed (a filter that passes 10% of 1M images fails
  900k), over-fetching would sort k + R scores per query, so `search` scores the live rows alone (`ids`: their
  sorted row ids, gathered by the search, which numbers its answers as the cache does). Both ways give the same
  rows and bit-equal scores: the gathered rows are scored in the whole search's block shapes.

With nothing removed every method is the identity (no copy, no extra rows fetched).

A filter on the images' fields (`cfir_jax.retrieve.filters`) narrows the rows for one call: the rows it fails
count as removed in the `LiveRows` it makes, and that object is an argument of every part the call runs (ER's lists,
BM25, SR's whole-cache searches, the result's count; `cfir_jax.retrieve.pipeline.Retriever.retrieve_many(docs,
live=...)`), so a reader and a static trace see which rows a search may return. The stores hold the version's own
(`Stores.live`), the default of a call that narrows nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

Ranked = tuple[np.ndarray, np.ndarray]  # (scores, rows), best first


class LiveRows:
    """The live rows of a cache of N rows. removed: bool [N] (None or all False: nothing removed)."""

    def __init__(self, removed: np.ndarray | None = None, num_rows: int | None = None):
        removed = None if removed is None else np.asarray(removed, bool)
        self.num_rows = int(num_rows if num_rows is not None else (0 if removed is None else len(removed)))
        self.num_removed = 0 if removed is None else int(removed.sum())
        self.removed = removed if self.num_removed else None
        self._ids: np.ndarray | None = None

    @classmethod
    def of(cls, cache) -> LiveRows:
        """The live rows of an opened `ImageCache`."""
        return cls(cache.removed, cache.num_images)

    def __repr__(self) -> str:
        return f"LiveRows({self.num_live} of {self.num_rows})"

    @property
    def num_live(self) -> int:
        return self.num_rows - self.num_removed

    def is_removed(self, rows: np.ndarray) -> np.ndarray:
        """bool [...] of rows [...] (int; padding ids < 0 count as not removed)."""
        rows = np.asarray(rows)
        if self.removed is None:
            return np.zeros(rows.shape, bool)
        return self.removed[np.where(rows >= 0, rows, 0)] & (rows >= 0)

    def keep(self, rows: np.ndarray, *aligned: np.ndarray):
        """rows [M] without the removed ones, order kept; with `aligned` arrays [M] (their scores), the pair."""
        if self.removed is None:
            return (rows, *aligned) if aligned else rows
        live = ~self.is_removed(rows)
        kept = np.asarray(rows)[live]
        return (kept, *(np.asarray(a)[live] for a in aligned)) if aligned else kept

    def fetch(self, k: int) -> int:
        """How many rows a whole-cache search must return so that k live ones are among them."""
        return int(k) + self.num_removed

    def top(self, scores: np.ndarray, rows: np.ndarray, k: int) -> Ranked:
        """A whole-cache search's answer (scores, rows) [Q, k'] (fetched with `fetch(k)`, padding id -1) -> each
        query's first k live rows [Q, k''], k'' = min(k, the most live rows any query got); shorter queries end in
        padding (id -1, score -inf) as ScaNN's do."""
        scores, rows = np.asarray(scores), np.asarray(rows)
        if self.removed is None:
            return scores[:, :k], rows[:, :k]
        live = ~self.is_removed(rows) & (rows >= 0)
        width = min(int(k), int(live.sum(axis=1).max(initial=0)))
        out_s = np.full((len(rows), width), -np.inf, np.float32)
        out_r = np.full((len(rows), width), -1, rows.dtype)
        for q in range(len(rows)):
            s, r = scores[q][live[q]][:width], rows[q][live[q]][:width]
            out_s[q, : len(s)], out_r[q, : len(r)] = s, r
        return out_s, out_r

    def ids(self) -> np.ndarray:
        """The live rows' ids [N - R], ascending (int64; made once per LiveRows, as a filter's call makes one)."""
        if self._ids is None:
            self._ids = np.arange(self.num_rows) if self.removed is None else np.flatnonzero(~self.removed)
        return self._ids

    def scores_live_only(self, k: int) -> bool:
        """Whether a whole-cache search for k scores the live rows alone: more rows removed than k (the over-fetch
        would more than double the k it sorts) and some live."""
        return self.num_removed > int(k) and self.num_live > 0

    def without(self, rows: np.ndarray) -> LiveRows:
        """These rows with `rows` counted as removed as well (the images a folded search set aside)."""
        removed = np.zeros(self.num_rows, bool) if self.removed is None else self.removed.copy()
        removed[np.asarray(rows, np.int64)] = True
        return LiveRows(removed, self.num_rows)

    def search(self, search: Callable[[int], Ranked], k: int,
               among: Callable[[np.ndarray, int], Ranked] | None = None) -> Ranked:
        """The top k live rows of a whole-cache search. search(k') -> (scores, rows) [Q, k'] over the whole cache,
        asked for k + R and cut to k live rows; among(ids, k') -> the same over the rows ids [V] only (numbered as
        in the cache), used when `scores_live_only(k)`."""
        if among is not None and self.scores_live_only(k):
            return self.top(*among(self.ids(), min(int(k), self.num_live)), k)
        return self.top(*search(self.fetch(k)), k)
