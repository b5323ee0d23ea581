"""A Ray front's scoring: the Retriever's `Scoring` (`cfir_jax.retrieve.scoring`) over the index shards.

The front runs the Retriever itself, every stage of every method: entities, summaries, query embeddings, ER (the
candidate lists and their union, read from the memory-mapped entity index), the method's ranking, BM25, the third
stage, the results. What it would score over the whole cache goes to the shards instead, at the version it serves:

1. SR of a batch's unions (`score_unions`): each union (sorted rows) is cut at the shards' bounds, every shard that
   holds part of one is sent the batch's queries and its parts in one call, and each query's top-k of every shard
   merge into its answer (`merge_ranked`: by score, ties to the lower row, as `cfir_jax.search.topk` orders);
2. an exact search over the live rows (`exact_search`: the dense methods, CFIR's no-entity fallback, the unseen
   entities' search when the index kept no ScaNN searcher, search by image): every shard searches its rows, and
   the merge keeps each query's k best.

With exact SR the answers equal one process's: ids, order and scores bit for bit (each shard scores a row as one
process does, and searches in the whole cache's block shape). With fast SR each shard shortlists its own part.
A front made so builds no device copy and no compact copy of the cache: it scores nothing itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cfir_jax.cluster.shard import IMAGES_ONLY, Ranked, ShardClient, shard_bounds
from cfir_jax.core.errors import CfirError
from cfir_jax.search.live_rows import LiveRows
from cfir_jax.search.topk import best_first


def merge_ranked(scores: Sequence[np.ndarray], rows: Sequence[np.ndarray], k: int) -> tuple[np.ndarray, np.ndarray]:
    """The best k of several (scores [k_i], rows [k_i]) by score, ties to the lower row (one process's rule:
    `cfir_jax.search.topk`), padding (row -1) dropped: (scores [k'], rows [k'])."""
    s = np.concatenate([np.asarray(x, np.float32) for x in scores]) if scores else np.zeros(0, np.float32)
    r = np.concatenate([np.asarray(x, np.int64) for x in rows]) if rows else np.zeros(0, np.int64)
    valid = np.flatnonzero(r >= 0)
    order = valid[best_first(s[valid], r[valid], k)]
    return s[order], r[order].astype(np.int32)


def split_union(union: np.ndarray, bounds: Sequence[tuple[int, int]]) -> list[np.ndarray]:
    """A sorted union's rows cut at the shards' bounds: one part per shard."""
    cuts = np.searchsorted(union, [lo for lo, _ in bounds[1:]])
    return np.split(np.asarray(union, np.int32), cuts)


class ShardedSR:
    """The Scoring of a Retriever whose candidates the shards score, every call at version `vid`
    (`ShardedSR.factory(client, vid)` is the Retriever's `scoring`)."""

    def __init__(self, rcfg, stores, fusion: tuple[float, float], fused: bool, client: ShardClient, vid: str):
        self.rcfg, self.fusion, self.fused = rcfg, fusion, fused
        self.live, self.top_k = stores.live, int(rcfg.top_k)
        self.client, self.vid = client, vid
        self.bounds = shard_bounds(stores.cache.num_images, client.shards)  # the shards' rows at this version

    @classmethod
    def factory(cls, client: ShardClient, vid: str):
        """What `Retriever(..., scoring=...)` takes."""
        return lambda rcfg, stores, fusion, fused: cls(rcfg, stores, fusion, fused, client, vid)

    def backend(self) -> str:
        return "shards"

    def prepare(self) -> None:
        """Nothing: the shards built their copies when they loaded this version."""

    def warm_up(self, max_batch: int) -> None:
        """Nothing: each shard warms its programs when it loads a version, before it answers."""

    def score_unions(self, queries: np.ndarray, unions: list[np.ndarray]) -> list[Ranked]:
        parts = [split_union(u, self.bounds) for u in unions]
        asked = {s: [p[s] for p in parts] for s in range(len(self.bounds)) if any(len(p[s]) for p in parts)}
        answers = self.client.score(self.vid, self.fused, np.asarray(queries, np.float32), asked) if asked else {}
        return [merge_ranked([answers[s][i][0] for s in answers], [answers[s][i][1] for s in answers], self.top_k)
                for i in range(len(unions))]

    def exact_search(self, queries: np.ndarray, k: int, live: LiveRows, weights: tuple[float, float] = IMAGES_ONLY
                     ) -> Ranked:
        """Every shard's exact top-k over its live rows, merged: (scores, rows) [Q, k'], k' = min(k, the most any
        query got), shorter queries padded (row -1, score -inf) as one process's are. For a call of fewer rows than
        the version's live ones (`live`: a filter's, `cfir_jax.retrieve.filters`, or folding's refill) the shards
        are asked past k and the rows of `live` kept."""
        if live is not self.live:
            return live.search(lambda fetch: self._merged(queries, fetch, weights), k)
        return self._merged(queries, k, weights)

    def _merged(self, queries: np.ndarray, k: int, weights: tuple[float, float]) -> Ranked:
        answers = self.client.search(self.vid, np.asarray(queries, np.float32), k, tuple(weights))
        merged = [merge_ranked([a[0][q] for a in answers], [a[1][q] for a in answers], k) for q in range(len(queries))]
        width = max((len(r) for _, r in merged), default=0)
        scores = np.full((len(merged), width), -np.inf, np.float32)
        rows = np.full((len(merged), width), -1, np.int32)
        for q, (s, r) in enumerate(merged):
            scores[q, : len(s)], rows[q, : len(r)] = s, r
        return scores, rows

    def full_search(self, query: np.ndarray, k: int, live: LiveRows) -> Ranked:
        scores, rows = self.exact_search(query[None], k, live, self.fusion if self.fused else IMAGES_ONLY)
        return scores[0], rows[0]

    def agreement(self, query: np.ndarray, union: np.ndarray, ranked_rows: np.ndarray) -> float:
        raise CfirError("fast SR's agreement with exact scoring is measured in one process (retrieve.py --evaluate "
                        "with retrieval.eval_sr=fast), not on the cluster")
