"""What a server asks of a retrieval engine: one typed interface, one implementation per way of answering.

The service (`cfir_jax.serve`: its resident index and micro-batcher) depends on `Engine` alone, and its HTTP app on
the service's own small interface (`cfir_jax.serve.app.SearchService`, which the cluster's gateway implements over
the fronts). The engines: the single process's `Retriever` (`cfir_jax.retrieve.pipeline`) and the cluster's
`ClusterRetriever` (`cfir_jax.serve.merge`: the same Retriever, its candidates scored by the index's shards). A new
way to serve is one module and one line in `cfir_jax.core.config_check.SERVE_ENGINES` (serve.engine's table).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from cfir_jax.retrieve.methods import Method
from cfir_jax.retrieve.pipeline import DocumentInput, Result


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

    def retrieve_many(self, docs: Sequence[DocumentInput]) -> list[Result]:
        """Each document's Result, in order (a batch runs its stages batched)."""

    def describe_image(self, image_id: str) -> tuple[str, str]:
        """(caption, url) of an image ('' when unknown)."""

    def cache_summaries(self, max_entries: int) -> None:
        """Keeps up to max_entries query summaries (a service's repeated documents)."""
