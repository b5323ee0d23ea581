"""The config's `entity_workers` section: the spaCy worker processes (`cfir_jax.nlp.entity_workers`, the one way spaCy
runs in another process) of every command that parses entities: the service, bulk retrieval, index.py's entity stage
and a query's helper. `cfir_jax.core.config.defaults` puts it under every experiment.

One section, not one per user: a pool is the same thing wherever it runs (the same worker, the same supervision),
and only how many workers and how long a chunk may take differ. It sits beside `index` and `serve`, not inside them:
`index.entities` says which entities a document has (the pipeline and labels, recorded with the store), and how many
processes find them changes no store.
"""

from __future__ import annotations

import ml_collections


def entity_workers_config() -> ml_collections.ConfigDict:
    """The `entity_workers` section (cfir_jax.nlp.entity_workers.Settings.of reads it)."""
    return ml_collections.ConfigDict(
        dict(
            serve=2,  # the service: processes parsing a batch's documents in parallel (< 2: the retrieval thread)
            bulk=2,  # retrieve.py --queries / --evaluate: processes parsing batches ahead of SR (< 2: the main thread)
            # index.py's entity stage: processes on each host; 0: one per core the host lets it use
            # (os.sched_getaffinity), no more than one per 100 documents to parse (a worker's start must pay:
            # entity_workers.DOCUMENTS_PER_WORKER; resolved by entity_workers.Settings.of), 1: the main thread parses
            index=0,
            # a service's worker holding a batch's chunk longer (or a second per entity_workers.CHARS_PER_S
            # characters of it, where that is more) is killed and replaced
            serve_deadline_ms=5000.0,
            deadline_ms=60000.0,  # the same for bulk retrieval, index.py and a query's helper
            max_restarts=5,  # more worker restarts than this within restart_window_s: the calling thread parses
            restart_window_s=60.0,
        )
    )
