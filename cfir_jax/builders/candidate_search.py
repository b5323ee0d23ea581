"""The search that fills the entity index: each entity's top-K images over the cache, by ScaNN or exactly.

Exact search runs on the devices when a GPU or TPU is present (the cache put there once, `cfir_jax.search.device_sr`)
and otherwise block by block on the host (`cfir_jax.search.topk.exact_topk`); ScaNN's searcher is built once and
shared by every process of a multi-host build. `measure_recall` compares stored candidates with exact search.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from cfir_jax.core import hosts
from cfir_jax.core.errors import CfirError
from cfir_jax.search import device_sr as sr_device
from cfir_jax.search.knn import ScannConfig, ScannSearcher, recall_at_k
from cfir_jax.search.topk import exact_topk

BACKENDS = ("scann", "exact")
# What index.entity_index.backend accepts: a backend, or "auto" (the default) for `resolve_backend`'s choice.
BACKEND_SETTINGS = ("auto", *BACKENDS)


def resolve_backend(setting: str) -> str:
    """The backend `index.entity_index.backend` names: 'auto' is exact top-K where a GPU or TPU is present (the
    paper's exact search, the cache resident on the devices) and ScaNN on CPU hosts (exact top-10,000 of millions of
    entities is days on a CPU); 'exact' and 'scann' are themselves. Anything else is one error line."""
    if setting not in BACKEND_SETTINGS:
        raise CfirError(f"index.entity_index.backend={setting!r}: use one of {', '.join(BACKEND_SETTINGS)}")
    if setting != "auto":
        return setting
    return "exact" if sr_device.has_accelerator() else "scann"


class CandidateSearcher:
    """One top-K search function over the image cache for either backend."""

    def __init__(self, backend: str, images: np.ndarray, k: int, scann: ScannSearcher | None):
        self.backend, self.images, self.k, self.scann = backend, images, k, scann
        self.device = None
        if backend == "exact":
            # On a GPU/TPU the cache goes onto the devices once (sharded if it must) instead of block by block.
            self.device = sr_device.DeviceCache(images) if sr_device.has_accelerator() else None

    def __call__(self, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.device is not None:
            return self.device.full_topk(queries, self.k)
        if self.backend == "exact":
            return exact_topk(queries, self.images, self.k)
        return self.scann.search(queries, self.k)


def make_searcher(
    backend: str, images: np.ndarray, k: int, scann_config: ScannConfig | None, scann_dir: Path | None
) -> CandidateSearcher:
    if backend not in BACKENDS:
        raise CfirError(f"backend={backend!r}: choose one of {BACKENDS}")
    scann = None
    if backend == "scann":
        if scann_dir is not None and (scann_dir / "cfir_scann.json").is_file():
            scann = ScannSearcher.load(scann_dir)
        else:
            scann = ScannSearcher.build(images, k, scann_config)
            if scann_dir is not None:
                scann.serialize(scann_dir)
    return CandidateSearcher(backend, images, k, scann)


def measure_recall(search: CandidateSearcher, embed: Callable[[np.ndarray], np.ndarray], n: int, candidates: Callable,
                    sample: int) -> float | None:
    """recall@K of the stored candidates against exact search, on `sample` of the `n` entities drawn with a fixed
    seed; embed(rows) -> [r, D] float32, candidates(rows) -> [r, K] int32 padded with -1."""
    if search.backend == "exact":
        return 1.0
    if sample <= 0 or n == 0:
        return None
    rows = np.sort(np.random.default_rng(0).choice(n, min(sample, n), replace=False))
    _, exact = exact_topk(np.asarray(embed(rows), np.float32), search.images, search.k)
    return recall_at_k(np.asarray(candidates(rows)), exact)  # padding (-1) is never in `exact`: counts as a miss


def shared_searcher(backend: str, images: np.ndarray, k: int, scann_config: ScannConfig | None, scann_dir: Path
                     ) -> CandidateSearcher:
    """The one searcher every process uses: for ScaNN, process 0 builds and serializes it into `scann_dir` (once; a
    resumed build reuses it) and every process, process 0 included, loads that file, so all search with the very
    same partitions whatever the process count."""
    if backend == "scann":
        if hosts.is_main() and not (scann_dir / "cfir_scann.json").is_file():
            ScannSearcher.build(images, k, scann_config).serialize(scann_dir)
        hosts.barrier("entity_index_searcher")
    return make_searcher(backend, images, k, scann_config, scann_dir if backend == "scann" else None)
