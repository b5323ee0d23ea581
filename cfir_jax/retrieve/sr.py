"""The SR front end: which scorer re-ranks a candidate union, and the whole-cache search the methods fall back to.

Backend (`retrieval.sr_backend`): "device" (the cache resident on the JAX devices, jitted exact SR over batches,
`cfir_jax.search.device_sr`), "cpu" (numpy), "auto" (device when a GPU or TPU is present). On the CPU,
`retrieval.sr="exact"` scores every candidate (the paper's SR, `cfir_jax.search.topk.exact_top_k`) and "fast" runs
the two-pass scorer over the compact int8 copy (`cfir_jax.search.cpu_sr`; the copy is built or checked when the
front end is made, so no query pays for it). Fused (`retrieval.fusion` other than (1, 0)), every scorer reads the
image cache and the image-text store as one [N, 2D] matrix (`cfir_jax.search.fused`) against [w_img q, w_txt q].
Removed images never come back: the unions SR scores are formed of live rows (`cfir_jax.retrieve.entity_ranking`),
and a whole-cache search over-fetches by the number of removed rows and keeps the live ones
(`cfir_jax.search.live_rows`).

The device copy is one per process and per row matrix (`resident_cache`): every served method's front end, and the
next generation of a service reloading the same cache, score on the one copy, which is freed with the last front end
that holds it. A Ray front scores nothing here: its Retriever is given the cluster's scoring
(`cfir_jax.cluster.scoring.ShardedSR`), so it builds no copy at all.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref

import numpy as np

from cfir_jax.core.errors import CfirError
from cfir_jax.search import device_sr
from cfir_jax.search.compact import CompactCache, build_compact
from cfir_jax.search.cpu_sr import SRScorer
from cfir_jax.search.fused import FusedRows, fused_queries
from cfir_jax.search.live_rows import LiveRows
from cfir_jax.search.topk import exact_top_k, exact_topk, span_topk, subset_topk
from cfir_jax.stores.contract import manifest_digest

Ranked = tuple[np.ndarray, np.ndarray]  # (scores [k'], cache rows [k'])

@dataclasses.dataclass(frozen=True)
class ScoredBy:
    """What scored a retriever's unions (`SRFrontEnd.scored_by`), for the report: its words, and whether it is the
    CPU's fast scorer (whose top-k agreement with exact scoring is measured) with its k."""

    label: str
    fast: bool
    top_k: int


# The device copies of this process, by what they hold and how (`resident_cache`): a copy lives as long as a front
# end holds it, so a reload of another cache frees the old copy with the old generation.
_RESIDENT: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_RESIDENT_LOCK = threading.Lock()


def resident_cache(rows, source: str, rcfg) -> device_sr.DeviceCache:
    """The process's device copy of `rows` ([N, D], or the fused [N, 2D] view) made from `source` (what identifies
    the rows: the cache's content fingerprint, with the image-text store's when fused) under rcfg's device settings
    (retrieval.top_k, sr_device_dtype, sr_device_shard, sr_buckets, sr_query_batch): made once, shared by every caller
    asking for the same."""
    shard = {"auto": None, "always": True, "never": False}[rcfg.sr_device_shard]
    settings = dict(k=int(rcfg.top_k), dtype=str(rcfg.sr_device_dtype), shard=shard,
                    buckets=tuple(int(b) for b in rcfg.sr_buckets), query_batch=int(rcfg.sr_query_batch))
    key = (source, tuple(rows.shape), *sorted(settings.items()))
    with _RESIDENT_LOCK:  # two methods opening at once (a service's loads) still make one copy
        cache = _RESIDENT.get(key)
        if cache is None:
            cache = _RESIDENT[key] = device_sr.DeviceCache(rows, **settings)
        return cache


class SRFrontEnd:
    """Scores unions and searches the whole cache for one retriever.

    stores: the opened `Stores` (cache, image text when fused); fusion: (w_img, w_txt); fused: whether SR fuses.
    """

    def __init__(self, rcfg, stores, fusion: tuple[float, float], fused: bool):
        self.rcfg, self.stores, self.fusion, self.fused = rcfg, stores, fusion, fused
        self.mode = rcfg.sr
        self.embeddings = stores.embeddings
        self.rows = self.embeddings  # what SR and the device cache score: [N, D], or [N, 2D] when fused
        if fused:
            self.rows = FusedRows(self.embeddings, stores.extra["image_text"].embeddings)
        self._cpu = self._device = None

    def backend(self) -> str:
        """'device' or 'cpu' (retrieval.sr_backend; 'auto' is device when a GPU or TPU is present)."""
        backend = self.rcfg.sr_backend  # auto, device or cpu (cfir_jax.core.config_check)
        if backend == "auto":
            backend = "device" if device_sr.has_accelerator() else "cpu"
        return backend

    def scored_by(self) -> ScoredBy:
        """What scores the unions (`cfir_jax.retrieve.report.sr_line` prints it)."""
        fast = self.mode == "fast" and self.backend() == "cpu"
        return ScoredBy(self.label(), fast, int(self.rcfg.top_k))

    def label(self) -> str:
        """What scores the unions, in words: the backend, the scorer and, on the device, the dtype of its copy against
        the stored rows' (a bfloat16 copy of a float16 cache scores rounded rows: not the paper's float32 SR)."""
        if self.backend() == "cpu":
            if self.mode == "exact":
                return "exact float32 dot product over the whole candidate union (the paper's), on the CPU"
            return f"fast (int8 compact copy, exact re-rank of {self.rcfg.sr_shortlist:,}) on the CPU"
        devices = self._device.shards if self._device is not None else 1
        stored, copy = np.dtype(self.rows.dtype).name, str(self.rcfg.sr_device_dtype)
        rows = "(the paper's)" if stored == copy else f"(rows rounded from the stored {stored}: not the paper's)"
        label = (f"exact float32 dot product over the whole candidate union on the device ({device_sr.platform()} "
                 f"x{devices}, a {copy} copy of the cache) {rows}")
        if self.mode == "fast":
            label += "; retrieval.sr='fast' names the CPU's two-pass scorer, the device scores every candidate"
        return label

    def prepare(self) -> None:
        """Builds now what the first query would otherwise wait for (minutes at scale): the compact copy for fast
        SR, or the device copy."""
        if self.mode == "fast" or self.backend() == "device":
            self.scorer()

    def source(self) -> str:
        """What identifies the rows SR scores: the cache's content fingerprint, with the image-text store's when
        fused."""
        source = self.stores.cache.content_fingerprint
        if self.fused:
            source += f"+text-{manifest_digest(self.stores.extra['image_text'].manifest)}"
        return source

    def device_cache(self):
        """The image cache resident on the local devices: the process's one copy of these rows (`resident_cache`),
        which SR and the exact searches of every method share."""
        if self._device is None:
            self._device = resident_cache(self.rows, self.source(), self.rcfg)
        return self._device

    def warm_up(self, max_batch: int) -> None:
        """On the device backend: compiles SR for every union bucket a union of this cache can fall in, at every query
        batch that a batch of up to max_batch documents sends (powers of two up to retrieval.sr_query_batch), before
        the first query: nothing compiles while a request waits. The CPU's scorers compile nothing."""
        if self.backend() != "device":
            return
        cache, n = self.device_cache(), self.rows.shape[0]
        buckets = sorted({device_sr.bucket_size(min(b, n), cache.buckets) for b in cache.buckets})
        for q in powers_of_two(min(cache.query_batch, max_batch)):
            queries = np.zeros((q, self.rows.shape[1]), np.float32)
            for bucket in buckets:
                cache.score_batch(queries, [np.arange(min(bucket, n), dtype=np.int32)] * q)

    def scorer(self):
        """The SR scorer of the configured backend; both have score_batch(queries [Q, D], unions) -> [(s, rows)]."""
        if self.backend() == "device":
            return self.device_cache()
        if self._cpu is None:
            self._cpu = self._cpu_scorer()
        return self._cpu

    def _cpu_scorer(self):
        """The two-pass scorer over the compact copy, which is rebuilt when missing or made from another cache (or
        dims). Fused, the copy is made of the [N, 2D] rows [image, image text], so it serves any weights."""
        layout, cache = self.stores.layout, self.stores.cache
        compact_dir = layout.sr_compact_fused if self.fused else layout.sr_compact
        source = self.source()
        dim = self.rows.shape[1]
        dims = min(self.rcfg.sr_compact_dims, dim)
        try:
            CompactCache.open(compact_dir, expect_n=cache.num_images, expect_dim=dim, expect_cache=source,
                              expect_dims=dims)
        except CfirError:  # derived data: missing, or made from another cache (or dims), is rebuilt
            build_compact(self.rows, compact_dir, dims=dims, cache_fingerprint=source)
        return SRScorer(self.rows, compact_dir, shortlist=self.rcfg.sr_shortlist, k=self.rcfg.top_k)

    def query_rows(self, queries: np.ndarray) -> np.ndarray:
        """Queries [Q, D] as SR scores them: [w_img q, w_txt q] when fused."""
        if self.fused:
            return fused_queries(queries, *self.fusion)
        return queries

    def score_unions(self, queries: np.ndarray, unions: list[np.ndarray]) -> list[Ranked]:
        """SR of sorted unique unions ([Q, D] queries, Q unions [M_i]): (scores [k'], cache rows [k']) per query.

        The device backend is exact by construction; on the CPU, `retrieval.sr="exact"` scores every candidate
        (the paper's SR) and "fast" runs the two-pass scorer.
        """
        queries = self.query_rows(queries)
        if self.mode == "exact" and self.backend() == "cpu":
            return [exact_top_k(self.rows, q, u, self.rcfg.top_k) for q, u in zip(queries, unions)]
        return self.scorer().score_batch(queries, unions)

    def agreement(self, query: np.ndarray, union: np.ndarray, ranked_rows: np.ndarray) -> float:
        """Fast SR's top-k overlap with exact scoring of the same union (measured outside the timed region)."""
        _, exact_rows = exact_top_k(self.rows, self.query_rows(query[None])[0], union, self.rcfg.top_k)
        return len(np.intersect1d(ranked_rows, exact_rows)) / max(len(exact_rows), 1)

    def exact_search(self, queries: np.ndarray, k: int, live: LiveRows, weights: tuple[float, float] = (1.0, 0.0),
                     span: tuple[int, int] | None = None) -> Ranked:
        """Exact top-k over the rows `live` of the whole cache (the call's: the version's live rows, or a filter's),
        queries [Q, D] -> [Q, k'] each, k' = min(k, live rows): on the devices when SR runs there. Removed rows (and
        a filter's failing ones) are never returned: with few of them, k + (removed rows) are searched and the live
        ones kept, else the live rows alone are scored (`cfir_jax.search.live_rows`).

        weights: (w_img, w_txt) of a fused retriever's search; the default scores the images alone.
        span: rows [lo, hi) only (a shard's, `cfir_jax.cluster.shard`), searched on the host in the whole cache's
        block shape, so that the shards' answers merge into this search's, scores bit-equal.
        """
        rows = self.embeddings
        if self.fused and (self.backend() == "device" or weights != (1.0, 0.0)):
            # The device holds the fused matrix only: an image-only search is the query [q, 0] against it.
            queries, rows = fused_queries(queries, *weights), self.rows
        if span is not None:
            return live.search(lambda fetch: span_topk(queries, rows, *span, fetch), k)
        if self.backend() == "device":
            cache = self.device_cache()
            return live.search(lambda fetch: cache.full_topk(queries, fetch), k,
                                    lambda ids, kk: cache.subset_topk(queries, ids, kk))
        return live.search(lambda fetch: exact_topk(queries, rows, min(fetch, len(rows))), k,
                                lambda ids, kk: subset_topk(queries, rows, ids, kk))

    def full_search(self, query: np.ndarray, k: int, live: LiveRows) -> Ranked:
        """One query [D] over the rows `live` of the whole cache, fused when SR is."""
        scores, rows = self.exact_search(query[None], k, live, self.fusion if self.fused else (1.0, 0.0))
        return scores[0], rows[0]


def powers_of_two(most: int) -> list[int]:
    """1, 2, 4, ... up to `most`, and `most` itself: the batch sizes a service sends (a warm-up runs each once)."""
    sizes, n = [], 1
    while n < most:
        sizes.append(n)
        n *= 2
    return [*sizes, max(1, int(most))]
