"""What a server asks of a retrieval engine, and what an engine asks of whatever scores its candidates: two typed
interfaces, each with one implementation per way of answering.

`Engine` is what the service calls (`cfir_jax.serve`: its resident index and micro-batcher; the HTTP app calls the
service's own small interface, `cfir_jax.serve.app.SearchService`). The Retriever (`cfir_jax.retrieve.pipeline`) is
an Engine in every process that serves: the single process's, and a front of the cluster (`cfir_jax.cluster`), the
same class over a `Scoring` of its own. The Retriever runs every stage of every method (entities, summaries,
encoding, ER, the method's ranking, the third stage, the results); the engines differ only where the candidates are
scored, so that is the interface with two implementations:

- `SRFrontEnd` (`cfir_jax.retrieve.sr`): this process scores, over the whole cache, on the CPU or the devices;
- `ShardedSR` (`cfir_jax.cluster.scoring`): each union's rows go to the index shard that holds them, each whole-cache
  search to every shard, and the shards' top-k merge into this process's answer (scores bit-equal with exact SR).

A Retriever takes its Scoring as `Retriever(..., scoring=...)`. A new way to serve is one module and its
`ServeEngine`, declared in its room's module `serve` (`cfir_jax.core.config_check.SERVE_ENGINES`, serve.engine's
choices, finds it there).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from cfir_jax.retrieve.methods import Method
from cfir_jax.retrieve.pipeline import DocumentInput, Retrieval

Ranked = tuple[np.ndarray, np.ndarray]  # (scores, cache rows), best first


@runtime_checkable
class Engine(Protocol):
    """One served method's retrieval over one version of a workdir."""

    method: str  # the method it answers (cfir, dense_summary, ...)
    notes: list[str]  # what it decided that the user should know
    methods: Method  # the method's parts (whether it summarises, reads entities, ...)

    @property
    def corpus(self):
        """The corpus: the images' captions, URLs and bytes (the HTML gallery)."""

    @property
    def entities(self):
        """The entity ranking when the method reads entities (the service's entity pool parses for it), else None."""

    def retrieve_many(self, docs: Sequence[DocumentInput]) -> list[Retrieval]:
        """Each document's Retrieval, in order (a batch runs its stages batched)."""

    def describe_image(self, image_id: str) -> tuple[str, str]:
        """(caption, url) of an image ('' when unknown)."""

    def cache_summaries(self, max_entries: int) -> None:
        """Keeps up to max_entries query summaries (a service's repeated documents)."""


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

    def exact_search(self, queries: np.ndarray, k: int, weights: tuple[float, float] = (1.0, 0.0)) -> Ranked:
        """Exact top-k over the live rows, queries [Q, D] -> (scores, rows) [Q, k'], padding row -1."""

    def full_search(self, query: np.ndarray, k: int) -> Ranked:
        """One query [D] over the whole cache (fused when SR is): (scores [k'], rows [k'])."""

    def agreement(self, query: np.ndarray, union: np.ndarray, ranked_rows: np.ndarray) -> float:
        """Fast SR's top-k overlap with exact scoring of the same union (evaluation)."""
