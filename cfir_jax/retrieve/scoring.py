"""What a Retriever asks of whatever scores its candidates: one typed interface, `Scoring`, with one implementation
per way of scoring.

The Retriever (`cfir_jax.retrieve.pipeline`) runs every stage of every method (entities, summaries, encoding, ER, the
method's ranking, the third stage, the results), held by the library's `Index` alone (`cfir_jax.api.index`), which
every door asks with its own verbs. A single process and a front of the cluster (`cfir_jax.cluster`) run the same
Retriever; they differ only where the candidates are scored, so that is the interface with two implementations:

- `SRFrontEnd` (`cfir_jax.retrieve.sr`): this process scores, over the whole cache, on the CPU or the devices;
- `ShardedSR` (`cfir_jax.cluster.scoring`): each union's rows go to the index shard that holds them, each whole-cache
  search to every shard, and the shards' top-k merge into this process's answer (scores bit-equal with exact SR).

A Retriever takes its Scoring as `Retriever(..., scoring=...)`. "Engine" names one thing: how a service runs
(serve.engine: one process, or Ray), each declared as a `ServeEngine` in its room's module `serve`
(`cfir_jax.core.config_check.SERVE_ENGINES` finds it there).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from cfir_jax.search.live_rows import LiveRows

Ranked = tuple[np.ndarray, np.ndarray]  # (scores, cache rows), best first


@runtime_checkable
class Scoring(Protocol):
    """What scores one Retriever's candidates: SR of its unions and its exact searches over the cache's live rows."""

    fused: bool  # SR scores [image, image text] rows against [w_img q, w_txt q]

    def backend(self) -> str:
        """What scores ('cpu', 'device', or 'shards')."""

    def prepare(self) -> None:
        """Builds now what the first query would wait for (the compact or the device copy; nothing elsewhere)."""

    def warm_up(self, max_batch: int) -> None:
        """Compiles what a batch of up to max_batch documents runs, before the first query."""

    def score_unions(self, queries: np.ndarray, unions: list[np.ndarray]) -> list[Ranked]:
        """SR of sorted unique unions (queries [Q, D], Q unions [M_i]): each query's top-k (scores, rows)."""

    def exact_search(self, queries: np.ndarray, k: int, live: LiveRows, weights: tuple[float, float] = (1.0, 0.0)
                     ) -> Ranked:
        """Exact top-k over the rows `live` (the call's: the version's live rows, or fewer under a filter), queries
        [Q, D] -> (scores, rows) [Q, k'], padding row -1."""

    def full_search(self, query: np.ndarray, k: int, live: LiveRows) -> Ranked:
        """One query [D] over the rows `live` of the whole cache (fused when SR is): (scores [k'], rows [k'])."""

    def agreement(self, query: np.ndarray, union: np.ndarray, ranked_rows: np.ndarray) -> float:
        """Fast SR's top-k overlap with exact scoring of the same union (evaluation)."""
