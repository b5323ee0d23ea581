"""BM25 search over a term-major score matrix (`cfir_jax.stores.lexical`): a query touches only its terms' postings.

A document used as a query is long (~400 words, ~150 distinct terms after stop words), and its common terms each
post to a large share of the collection: summing every posting and then taking the top k of all N images would
cost O(N) per query (~40 ms at 4M for the top-k alone). Instead:

- only the touched rows are accumulated, in a float32 buffer of N kept per thread and reset after each query, and the
  top k is taken among them (O(postings read));
- the query's terms are read rarest first (highest idf, shortest posting list) and pruned: at most `max_terms` terms,
  and no more terms once `max_postings` postings are read (the first term is always read). A common term adds a small
  score to very many rows and rarely decides a top-k; the names this store exists for are rare. Both 0: every
  term is read and the scores are exact BM25 (what the parity test checks).

Ties go to the lower row. Removed rows (`cfir_jax.search.live_rows`) are dropped before the cut to k.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

from cfir_jax.search.live_rows import LiveRows
from cfir_jax.search.topk import best_first

Ranked = tuple[np.ndarray, np.ndarray]  # (scores float32 [k], rows int32 [k]), best first


@dataclasses.dataclass(frozen=True)
class Pruning:
    max_terms: int = 0  # the rarest terms read per query (0: all)
    max_postings: int = 0  # stop adding terms once this many postings are read (0: no limit)


class BM25Search:
    """Top-k BM25 over a term-major matrix: term j posts rows indices[indptr[j]:indptr[j+1]] with scores data[...]."""

    def __init__(self, indptr: np.ndarray, indices: np.ndarray, data: np.ndarray, num_rows: int,
                 live: LiveRows | None = None, pruning: Pruning = Pruning()):
        self.indptr, self.indices, self.data = np.asarray(indptr), indices, data
        self.num_rows, self.pruning = int(num_rows), pruning
        self.live = live if live is not None else LiveRows(None, num_rows)
        self.lengths = np.diff(self.indptr)
        self._local = threading.local()

    def _buffers(self) -> tuple[np.ndarray, np.ndarray]:
        if not hasattr(self._local, "acc"):
            self._local.acc = np.zeros(self.num_rows, np.float32)
            self._local.seen = np.zeros(self.num_rows, bool)
        return self._local.acc, self._local.seen

    def chosen_terms(self, cols: np.ndarray) -> np.ndarray:
        """Positions of `cols` read for a query: rarest first, cut by the pruning."""
        order = np.argsort(self.lengths[cols], kind="stable")
        p = self.pruning
        if p.max_terms:
            order = order[: p.max_terms]
        if p.max_postings and len(order):
            read = np.cumsum(self.lengths[cols[order]])
            order = order[: max(1, int(np.searchsorted(read, p.max_postings, side="right")))]
        return order

    def search(self, cols: np.ndarray, weights: np.ndarray, k: int, live: LiveRows | None = None) -> Ranked:
        """The k best rows of `live` (None: this search's own live rows) for query terms `cols` [u] weighted by
        `weights` [u] (their counts in the query)."""
        acc, seen = self._buffers()
        touched = []
        for i in self.chosen_terms(np.asarray(cols)):
            lo, hi = self.indptr[cols[i]], self.indptr[cols[i] + 1]
            rows = np.asarray(self.indices[lo:hi])
            acc[rows] += weights[i] * np.asarray(self.data[lo:hi], np.float32)  # rows of one term are distinct
            new = rows[~seen[rows]]
            seen[new] = True
            touched.append(new)
        rows = np.concatenate(touched) if touched else np.zeros(0, np.int32)
        scores = acc[rows].copy()
        acc[rows], seen[rows] = 0.0, False
        rows, scores = (self.live if live is None else live).keep(rows, scores)
        return top_k(scores, rows, k)


def top_k(scores: np.ndarray, rows: np.ndarray, k: int) -> Ranked:
    """The k best (score, row) pairs, best first, ties to the lower row."""
    if len(scores) > k:
        cut = np.partition(scores, len(scores) - k)[len(scores) - k]
        keep = scores >= cut
        scores, rows = scores[keep], rows[keep]
    order = best_first(scores, rows, k)
    return scores[order].astype(np.float32), rows[order].astype(np.int32)
