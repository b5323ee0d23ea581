"""Summary re-ranking (SR): score the union of a document's entity candidates with its summary embedding, fast.

A query's union holds ~55,000 of the cache's millions of images. Gathering 55k float16 rows of 768 dims (84 MB)
and scoring them exactly costs ~85-200 ms on 2 CPU cores; CFIR's budget is ~5 ms. So scoring runs in two passes:

1. approximate: a compact copy of the cache, built once offline (`build_compact`) and memory-mapped: each row
   rotated onto the top-r principal directions of the cache (uncentered PCA, so dot products are preserved up to
   the dropped directions) and quantised to int8 with a per-row scale: r bytes per row (128 by default, 6x less
   than float16). All candidates are gathered and scored from it in cache-sized chunks on both cores.
2. exact: the best `shortlist` candidates are gathered from the float16 cache and re-scored in float32 by one
   jitted function padded to power-of-two buckets (so no candidate count ever compiles it again), which also takes
   the final top-k.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from cfir_jax.errors import CfirError
from cfir_jax.store import atomic_dir, check_manifest, read_manifest, write_manifest

COMPACT_KIND = "sr_compact"
COMPACT_VERSION = 1
_CHUNK_ROWS = 1024  # int8 -> float32 conversion chunk: 1024 x 128 x 4 B = 512 KiB stays in L2.


@dataclasses.dataclass
class CompactCache:
    """The compact scoring copy of an image cache.

    rotation [D, r] float32 (orthonormal columns), codes [N, r] int8, scales [N] float32:
    row n ~= scales[n] * codes[n] @ rotation.T.
    """

    rotation: np.ndarray
    codes: np.ndarray
    scales: np.ndarray

    @property
    def dims(self) -> int:
        return self.codes.shape[1]

    @classmethod
    def open(cls, directory: str | os.PathLike, expect_n: int | None = None, expect_dim: int | None = None):
        """Memory-maps a directory written by `build_compact`; raises StoreError if it is for another cache."""
        manifest = read_manifest(directory, COMPACT_KIND, COMPACT_VERSION)
        expected = {key: v for key, v in dict(n=expect_n, dim=expect_dim).items() if v is not None}
        check_manifest(manifest, directory, **expected)
        d = Path(directory)
        return cls(
            rotation=np.load(d / "rotation.npy"),
            codes=np.load(d / "codes.npy", mmap_mode="r"),
            scales=np.load(d / "scales.npy", mmap_mode="r"),
        )


def _principal_directions(cache: np.ndarray, dims: int, sample: int, seed: int) -> np.ndarray:
    """Top-`dims` eigenvectors of the uncentered second moment of a row sample: [D, dims] float32."""
    n = cache.shape[0]
    rows = np.sort(np.random.default_rng(seed).choice(n, size=min(sample, n), replace=False))
    x = np.asarray(cache[rows], dtype=np.float64)
    # Uncentered: we approximate q . x, not x - mean, so the mean direction must stay in the basis.
    _, vecs = np.linalg.eigh(x.T @ x)
    return np.ascontiguousarray(vecs[:, ::-1][:, :dims], dtype=np.float32)


def quantize_rows(rotated: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[n, r] float32 -> (codes [n, r] int8, scales [n] float32) with symmetric per-row scaling."""
    amax = np.abs(rotated).max(axis=1)
    scales = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    codes = np.clip(np.rint(rotated / scales[:, None]), -127, 127).astype(np.int8)
    return codes, scales


def build_compact(
    cache: np.ndarray,
    out_path: str | os.PathLike,
    dims: int = 128,
    sample: int = 100_000,
    chunk_rows: int = 65536,
    seed: int = 0,
    progress: bool = False,
) -> CompactCache:
    """Builds the compact scoring copy of cache [N, D] (f16/f32, memmap fine) into directory `out_path`.

    Writes rotation.npy [D, dims] f32, codes.npy [N, dims] int8, scales.npy [N] f32 and a manifest, atomically.
    """
    if cache.ndim != 2 or cache.shape[0] == 0:
        raise CfirError(f"build_compact: cache must be a non-empty [N, D] matrix, got shape {cache.shape}")
    n, dim = cache.shape
    if not 1 <= dims <= dim:
        raise CfirError(f"build_compact: dims={dims} must be in [1, {dim}] (the cache dim)")
    rotation = _principal_directions(cache, dims, sample, seed)
    with atomic_dir(out_path) as tmp:
        np.save(tmp / "rotation.npy", rotation)
        codes = np.lib.format.open_memmap(tmp / "codes.npy", mode="w+", dtype=np.int8, shape=(n, dims))
        scales = np.lib.format.open_memmap(tmp / "scales.npy", mode="w+", dtype=np.float32, shape=(n,))
        for start in tqdm(range(0, n, chunk_rows), desc="compact cache", disable=not progress):
            block = np.asarray(cache[start : start + chunk_rows], dtype=np.float32)
            codes[start : start + len(block)], scales[start : start + len(block)] = quantize_rows(block @ rotation)
        codes.flush()
        scales.flush()
        del codes, scales
        write_manifest(tmp, COMPACT_KIND, COMPACT_VERSION, n=n, dim=dim, dims=dims, sample=min(sample, n))
    return CompactCache.open(out_path)


def compact_in_memory(cache: np.ndarray, dims: int = 128, sample: int = 100_000, seed: int = 0) -> CompactCache:
    """The same representation as `build_compact`, kept in memory (tests, small caches)."""
    rotation = _principal_directions(cache, dims, sample, seed)
    codes, scales = quantize_rows(np.asarray(cache, dtype=np.float32) @ rotation)
    return CompactCache(rotation, codes, scales)


def _rerank_topk(rows: jax.Array, query: jax.Array, ids: jax.Array, n_valid: jax.Array, *, k: int):
    """Exact float32 scores of rows [S, D] (f16) against query [D]; rows >= n_valid are padding.

    Returns (scores [k], ids [k]) best first.
    """
    scores = jnp.dot(rows.astype(jnp.float32), query, precision=jax.lax.Precision.HIGHEST)
    scores = jnp.where(jnp.arange(rows.shape[0]) < n_valid, scores, -jnp.inf)
    top, pos = jax.lax.top_k(scores, k)
    return top, ids[pos]


def _bucket(m: int, smallest: int) -> int:
    return max(smallest, 1 << math.ceil(math.log2(max(1, m))))


def unique_sorted(candidates: np.ndarray) -> np.ndarray:
    """Sorted unique ids of candidates [M] int32; a sort is ~20x faster than np.unique here and aids locality."""
    s = np.sort(np.asarray(candidates, dtype=np.int32))
    if s.size == 0:
        return s
    keep = np.empty(s.size, np.bool_)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


class SRScorer:
    """Scores a candidate union against a summary embedding: approximate int8 pass, exact float32 re-rank, top-k.

    cache_embeddings [N, D] float16/float32 (memmap fine); compact: a CompactCache (or a directory written by
    build_compact); shortlist: candidates re-scored exactly (>= k); k: results returned.
    """

    def __init__(
        self,
        cache_embeddings: np.ndarray,
        compact: CompactCache | str | os.PathLike,
        shortlist: int = 4096,
        k: int = 1000,
        threads: int = 2,
        max_traces: int | None = None,
    ):
        if cache_embeddings.ndim != 2:
            raise CfirError(f"SR cache must be [N, D], got shape {cache_embeddings.shape}")
        if not isinstance(compact, CompactCache):
            compact = CompactCache.open(compact, expect_n=cache_embeddings.shape[0], expect_dim=cache_embeddings.shape[1])
        if compact.codes.shape[0] != cache_embeddings.shape[0] or compact.rotation.shape[0] != cache_embeddings.shape[1]:
            raise CfirError(
                f"compact cache is for [{compact.codes.shape[0]}, {compact.rotation.shape[0]}] but the image cache is "
                f"{list(cache_embeddings.shape)}; rebuild it with build_compact"
            )
        if shortlist < k:
            raise CfirError(f"shortlist={shortlist} must be >= k={k}")
        self.cache = cache_embeddings
        self.compact = compact
        self.k = k
        self.shortlist = shortlist
        self.threads = max(1, threads)
        self._pool = concurrent.futures.ThreadPoolExecutor(self.threads) if self.threads > 1 else None
        # Smallest bucket holds k so top_k(k) is always defined; then powers of two up to the shortlist's.
        self.min_bucket = _bucket(k, 1)
        top = _bucket(shortlist, self.min_bucket)
        self.buckets = [self.min_bucket << i for i in range(int(math.log2(top // self.min_bucket)) + 1)]

        def rerank(rows, query, ids, n_valid):
            return _rerank_topk(rows, query, ids, n_valid, k=k)

        if max_traces is not None:
            # Each scorer wraps its own function, so chex counts this scorer's compilations only.
            rerank = chex.assert_max_traces(rerank, n=max_traces)
        self._rerank = jax.jit(rerank)

    def _approx_chunk(self, ids: np.ndarray, query_r: np.ndarray, out: np.ndarray) -> None:
        codes = self.compact.codes
        gathered = np.empty((_CHUNK_ROWS, codes.shape[1]), np.int8)
        as_float = np.empty((_CHUNK_ROWS, codes.shape[1]), np.float32)
        for c0 in range(0, ids.size, _CHUNK_ROWS):
            part = ids[c0 : c0 + _CHUNK_ROWS]
            m = part.size
            np.take(codes, part, axis=0, out=gathered[:m])
            as_float[:m] = gathered[:m]
            np.dot(as_float[:m], query_r, out=out[c0 : c0 + m])
        out *= np.take(self.compact.scales, ids)

    def approximate_scores(self, query: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Compact-copy scores of sorted unique ids [M] for query [D]: [M] float32."""
        query_r = np.ascontiguousarray(query @ self.compact.rotation, dtype=np.float32)
        out = np.empty(ids.size, np.float32)
        if self._pool is None or ids.size < 4 * _CHUNK_ROWS:
            self._approx_chunk(ids, query_r, out)
            return out
        # numpy releases the GIL in take/copy/BLAS, so threads over contiguous slices use every core.
        bounds = np.linspace(0, ids.size, self.threads + 1).astype(int)
        futures = [
            self._pool.submit(self._approx_chunk, ids[a:b], query_r, out[a:b]) for a, b in zip(bounds[:-1], bounds[1:])
        ]
        for f in futures:
            f.result()
        return out

    def score(self, query: np.ndarray, candidate_indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """query [D] float32, candidate_indices [M] int (duplicates allowed) -> (scores [k'], indices [k'] int32).

        k' = min(k, unique candidates); best first; scores are exact float32 dot products with the cache rows.
        """
        query = np.asarray(query, dtype=np.float32)
        if query.shape != (self.cache.shape[1],):
            raise CfirError(f"SR query must have shape [{self.cache.shape[1]}], got {query.shape}")
        ids = unique_sorted(candidate_indices)
        if ids.size == 0:
            return np.zeros(0, np.float32), np.zeros(0, np.int32)
        if ids[0] < 0 or ids[-1] >= self.cache.shape[0]:
            raise CfirError(f"candidate ids must be in [0, {self.cache.shape[0]}); got {ids[0]}..{ids[-1]}")
        if ids.size > self.shortlist:
            approx = self.approximate_scores(query, ids)
            keep = np.argpartition(approx, ids.size - self.shortlist)[ids.size - self.shortlist :]
            short = ids[np.sort(keep)]  # sorted ids: the float16 gather walks the cache forwards.
        else:
            short = ids
        m = short.size
        bucket = _bucket(m, self.min_bucket)
        padded = np.zeros(bucket, np.int32)
        padded[:m] = short
        rows = np.take(self.cache, padded, axis=0)
        top, top_ids = self._rerank(rows, query, padded, np.int32(m))
        kk = min(self.k, m)
        return np.asarray(top)[:kk], np.asarray(top_ids)[:kk]

    def score_batch(
        self, queries: np.ndarray, candidate_lists: list[np.ndarray]
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """`score` for each (queries[i] [D], candidate_lists[i] [M_i]) pair."""
        if len(queries) != len(candidate_lists):
            raise CfirError(f"{len(queries)} queries but {len(candidate_lists)} candidate lists")
        return [self.score(q, c) for q, c in zip(queries, candidate_lists)]
