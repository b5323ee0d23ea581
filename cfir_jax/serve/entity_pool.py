"""spaCy entity extraction for the service in persistent worker processes, so a batch is parsed on every core.

spaCy is most of a query's work (about two thirds on the demo index) and runs on one core under the GIL; the
retrieval thread then leaves the machine's other cores idle. `EntityPool` keeps `serve.entity_workers` processes,
each with the pipeline loaded once at start-up (never per batch, as `nlp.pipe(n_process=...)` would), and splits a
batch's documents among them in contiguous slices. The workers start from a forkserver, never by forking this
multithreaded JAX process. Their entities are those `EntityExtractor` finds in the retrieval thread: the same
pipeline, labels and normalisation (tested: answers equal `retrieve.py --format json`).
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
from collections.abc import Sequence

_extractor = None  # in a worker process: its EntityExtractor, loaded by `_load`


def _load(spacy_model: str, labels) -> None:
    global _extractor
    from cfir_jax.index.entities import EntityExtractor, load_spacy

    _extractor = EntityExtractor(load_spacy(spacy_model or None), labels)


def _extract(texts: Sequence[str]) -> list[list[str]]:
    return list(_extractor.extract(texts))


class EntityPool:
    """`entities(texts)` -> each text's entities, parsed by `workers` processes (each a slice of the texts)."""

    def __init__(self, spacy_model: str, labels, workers: int):
        self.key = (spacy_model, tuple(labels) if isinstance(labels, (list, tuple)) else labels)
        self.workers = int(workers)
        self._pool = concurrent.futures.ProcessPoolExecutor(
            self.workers, mp_context=multiprocessing.get_context("forkserver"), initializer=_load,
            initargs=(spacy_model, labels))
        # Start every worker and load its pipeline now (start-up), not in the first requests' time.
        for f in [self._pool.submit(_extract, ["warm up"]) for _ in range(2 * self.workers)]:
            f.result()

    def entities(self, texts: Sequence[str]) -> list[list[str]]:
        n = min(self.workers, len(texts))
        bounds = [len(texts) * i // n for i in range(n + 1)]
        futures = [self._pool.submit(_extract, list(texts[a:b])) for a, b in zip(bounds, bounds[1:])]
        return [found for f in futures for found in f.result()]

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
