"""Summary re-ranking (SR) on the CPU: score the union of a document's entity candidates with its summary, fast.

A query's union holds ~55,000 of the cache's millions of images. Gathering 55k float16 rows of 768 dims (84 MB)
and scoring them exactly costs ~100 ms on 2 CPU cores; CFIR's budget is ~5 ms. So scoring runs in two passes:

1. approximate: every unique candidate is gathered and scored from the compact int8 copy of the cache
   (`cfir_jax.search.compact`, built once offline by `build_compact`).
2. exact: the best `shortlist` candidates are gathered from the float16 cache and re-scored in float32; the final
   top-k is taken with argpartition over the shortlist.

Why this shape: the approximate pass is bound by memory latency (one random 128-byte row per candidate), recall
comes from the number of PCA dims rather than the quantisation, and the exact pass's cost is gathering the shortlist's
float16 rows and casting them to float32: torch's vectorised cast when torch is loaded (optional, never required),
otherwise four integer and float passes of numpy (`cfir_jax.search.topk.cast_f16`), with no jit in the per-query
path. Stage times, and what was tried and measured slower (a 64-dim copy, two threads), are in docs/retrieval.md
("SR: exact or fast") and benchmarks/RESULTS.md.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
import time

import numpy as np

from cfir_jax.core.errors import CfirError
from cfir_jax.search.compact import CompactCache
from cfir_jax.search.topk import cast_f16, top_k_positions, unique_sorted

# Approximate pass chunk: 512 x 128 codes as int8 + float32 = 320 KiB stays in L2 (256-1024 measured alike).
_CHUNK_ROWS = 512
# Exact pass chunk: 128 rows x 768 as float16 + float32 = 576 KiB, about one core's L2. Casting the whole shortlist
# at once (10 MB) measured 4x slower at p50 under load: the float32 copy goes to DRAM and back.
_EXACT_CHUNK_ROWS = 128
# Below these sizes a thread hand-off (~20-50 us) costs more than the second core saves.
_PARALLEL_MIN_APPROX = 8 * _CHUNK_ROWS
_PARALLEL_MIN_EXACT = 512


@dataclasses.dataclass
class StageTimes:
    """Wall seconds per `SRScorer.score` call, one entry per call, per stage (filled when passed to score)."""

    dedup: list[float] = dataclasses.field(default_factory=list)
    approximate: list[float] = dataclasses.field(default_factory=list)
    shortlist: list[float] = dataclasses.field(default_factory=list)
    exact: list[float] = dataclasses.field(default_factory=list)

    def p50_ms(self) -> dict[str, float]:
        """Median milliseconds per stage."""
        return {k: float(np.median(v)) * 1e3 for k, v in dataclasses.asdict(self).items() if v}


class SRScorer:
    """Scores a candidate union against a summary embedding: approximate int8 pass, exact float32 re-rank, top-k.

    cache_embeddings [N, D] float16/float32 (memmap fine, in memory faster); compact: a CompactCache (or a directory
    written by build_compact); shortlist: candidates re-scored exactly (>= k; 2560 keeps >= 99% of the exact top-1000
    at 4M x 768 with a 128-dim compact copy); k: results returned; threads: workers for the two passes (1 leaves the
    other core to the rest of the pipeline). Buffers are preallocated and reused, so one scorer serves one call at a
    time (calls are serialised by a lock; use one scorer per thread for concurrency).
    """

    def __init__(
        self,
        cache_embeddings: np.ndarray,
        compact: CompactCache | str | os.PathLike,
        shortlist: int = 2560,
        k: int = 1000,
        threads: int = 1,
    ):
        if cache_embeddings.ndim != 2:
            raise CfirError(f"SR cache must be [N, D], got shape {cache_embeddings.shape}")
        if cache_embeddings.dtype not in (np.float16, np.float32):
            raise CfirError(f"SR cache must be float16 or float32, got {cache_embeddings.dtype}")
        if not isinstance(compact, CompactCache):
            n, dim = cache_embeddings.shape
            compact = CompactCache.open(compact, expect_n=n, expect_dim=dim)
        if (
            compact.codes.shape[0] != cache_embeddings.shape[0]
            or compact.rotation.shape != (cache_embeddings.shape[1], compact.dims)
            or compact.scales.shape != (compact.dims,)
        ):
            raise CfirError(
                f"compact cache is for [{compact.codes.shape[0]}, {compact.rotation.shape[0]}] but the image cache is "
                f"{list(cache_embeddings.shape)}; rebuild it with build_compact"
            )
        if k < 1 or shortlist < k:
            raise CfirError(f"need 1 <= k <= shortlist, got k={k}, shortlist={shortlist}")
        self.cache = cache_embeddings
        self._take_rows = getattr(cache_embeddings, "take_rows", None)
        self.compact = compact
        self.k = k
        self.shortlist = shortlist
        self.threads = max(1, threads)
        self._pool = concurrent.futures.ThreadPoolExecutor(self.threads) if self.threads > 1 else None
        self._lock = threading.Lock()
        # Per-worker scratch: gathered codes and their float32 cast, one conversion chunk each.
        r = compact.dims
        self._codes_buf = [np.empty((_CHUNK_ROWS, r), np.int8) for _ in range(self.threads)]
        self._float_buf = [np.empty((_CHUNK_ROWS, r), np.float32) for _ in range(self.threads)]
        chunk = (_EXACT_CHUNK_ROWS, cache_embeddings.shape[1])
        self._rows = [np.empty(chunk, cache_embeddings.dtype) for _ in range(self.threads)]
        self._rows_f32 = [
            rows if rows.dtype == np.float32 else np.empty(chunk, np.float32) for rows in self._rows
        ]
        self._exact = np.empty(shortlist, np.float32)

    def _split(self, m: int, parallel_min: int) -> list[tuple[int, int]]:
        """[0, m) as one contiguous slice per worker (one slice when m < parallel_min is not worth a hand-off)."""
        parts = self.threads if (self._pool is not None and m >= parallel_min) else 1
        bounds = np.linspace(0, m, parts + 1).astype(int)
        return list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))

    def _run(self, fn, m: int, parallel_min: int) -> None:
        """Calls fn(worker, start, stop) over the worker slices of [0, m), in parallel when it pays."""
        slices = self._split(m, parallel_min)
        if len(slices) == 1:
            fn(0, 0, m)
            return
        for f in [self._pool.submit(fn, w, a, b) for w, (a, b) in enumerate(slices)]:
            f.result()

    def _check_ids(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise CfirError(f"candidate ids must be a 1-D integer array, got {ids.dtype} {ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.cache.shape[0]):
            raise CfirError(f"candidate ids must be in [0, {self.cache.shape[0]}); got {ids.min()}..{ids.max()}")
        return ids

    def approximate_scores(self, query: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Compact-copy scores of ids [M] (sorted ids gather fastest) for query [D]: [M] float32."""
        ids = self._check_ids(ids)
        with self._lock:
            return self._approximate(np.asarray(query, np.float32), ids)

    def exact_scores(self, query: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """float32 dot products of cache rows ids [S] (S <= shortlist; sorted gather fastest) with query [D]: [S]."""
        ids = self._check_ids(ids)
        if ids.size > self.shortlist:
            raise CfirError(f"exact_scores takes at most shortlist={self.shortlist} ids, got {ids.size}")
        with self._lock:
            return self._exact_scores(np.asarray(query, np.float32), ids)

    def _approximate(self, query: np.ndarray, ids: np.ndarray) -> np.ndarray:
        weights = self.compact.query(query)
        codes = self.compact.codes
        out = np.empty(ids.size, np.float32)

        def work(w: int, a: int, b: int) -> None:
            gathered, as_float = self._codes_buf[w], self._float_buf[w]
            for c0 in range(a, b, len(gathered)):
                m = min(len(gathered), b - c0)
                # mode="clip" skips numpy's per-index bounds check and the buffered copy that mode="raise" makes
                # with out=; ids were range-checked once by the caller.
                np.take(codes, ids[c0 : c0 + m], axis=0, out=gathered[:m], mode="clip")
                np.copyto(as_float[:m], gathered[:m])
                with np.errstate(all="ignore"):  # per thread: a damaged row's scores are refused after, in one line
                    np.dot(as_float[:m], weights, out=out[c0 : c0 + m])

        self._run(work, ids.size, _PARALLEL_MIN_APPROX)
        return out

    def _exact_scores(self, query: np.ndarray, ids: np.ndarray) -> np.ndarray:
        out = self._exact[: ids.size]

        def work(w: int, a: int, b: int) -> None:
            rows, as_float = self._rows[w], self._rows_f32[w]
            for c0 in range(a, b, _EXACT_CHUNK_ROWS):
                m = min(_EXACT_CHUNK_ROWS, b - c0)
                if self._take_rows is not None:  # a view over several stores (image text fusion: FusedRows)
                    self._take_rows(ids[c0 : c0 + m], rows[:m])
                else:
                    np.take(self.cache, ids[c0 : c0 + m], axis=0, out=rows[:m], mode="clip")
                if as_float is not rows:
                    # float16 values are exact in float32, so this equals the float32 reference up to summation
                    # order. The product runs in numpy's BLAS (sgemv 3x faster than torch.mv here).
                    cast_f16(rows[:m], as_float[:m])
                with np.errstate(all="ignore"):  # per thread: a damaged row's scores are refused after, in one line
                    np.dot(as_float[:m], query, out=out[c0 : c0 + m])

        self._run(work, ids.size, _PARALLEL_MIN_EXACT)
        return out.copy()

    def score(
        self, query: np.ndarray, candidate_indices: np.ndarray, times: StageTimes | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """query [D] float32, candidate_indices [M] int (duplicates allowed) -> (scores [k'], indices [k'] int32).

        k' = min(k, unique candidates); best first; scores are exact float32 dot products with the cache rows.
        times, if given, receives this call's wall seconds per stage.
        """
        query = np.asarray(query, dtype=np.float32)
        if query.shape != (self.cache.shape[1],):
            raise CfirError(f"SR query must have shape [{self.cache.shape[1]}], got {query.shape}")
        candidate_indices = np.asarray(candidate_indices)
        if candidate_indices.ndim != 1 or not np.issubdtype(candidate_indices.dtype, np.integer):
            raise CfirError(
                f"candidate ids must be a 1-D integer array, got {candidate_indices.dtype} {candidate_indices.shape}"
            )
        n = self.cache.shape[0]
        if candidate_indices.dtype != np.int32 and candidate_indices.size and (
            candidate_indices.min() < 0 or candidate_indices.max() >= n
        ):
            # Checked before unique_sorted's int32 cast, which would wrap ids >= 2**31 into range silently.
            raise CfirError(
                f"candidate ids must be in [0, {n}); got {candidate_indices.min()}..{candidate_indices.max()}"
            )
        with self._lock:
            t0 = time.perf_counter()
            ids = unique_sorted(candidate_indices)
            if ids.size == 0:
                return np.zeros(0, np.float32), np.zeros(0, np.int32)
            if ids[0] < 0 or ids[-1] >= n:
                raise CfirError(f"candidate ids must be in [0, {n}); got {ids[0]}..{ids[-1]}")
            t1 = time.perf_counter()
            if ids.size > self.shortlist:
                approx = self._approximate(query, ids)
                t2 = time.perf_counter()
                keep = np.argpartition(approx, ids.size - self.shortlist)[ids.size - self.shortlist :]
                short = ids[np.sort(keep)]  # sorted ids: the float16 gather walks the cache forwards.
            else:
                t2 = t1
                short = ids
            t3 = time.perf_counter()
            exact = self._exact_scores(query, short)
            best = top_k_positions(exact, self.k)
            scores, top_ids = exact[best], short[best]
            t4 = time.perf_counter()
        if times is not None:
            for stage, dt in zip(("dedup", "approximate", "shortlist", "exact"), (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                getattr(times, stage).append(dt)
        return scores, top_ids

    def score_batch(
        self, queries: np.ndarray, candidate_lists: list[np.ndarray], times: StageTimes | None = None
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """`score` for each (queries[i] [D], candidate_lists[i] [M_i]) pair."""
        if len(queries) != len(candidate_lists):
            raise CfirError(f"{len(queries)} queries but {len(candidate_lists)} candidate lists")
        return [self.score(q, c, times) for q, c in zip(queries, candidate_lists)]
