"""The compact scoring copy of an image cache: rows rotated onto their top principal directions and quantised to int8.

Built once offline (`build_compact`, W/sr_compact): each row rotated onto the top-r principal directions of the cache
(uncentered PCA, so dot products are preserved up to the dropped directions) and quantised to int8 with one scale per
dimension: r bytes per row (128 by default, 6x less than float16). The CPU SR scorer's approximate pass
(`cfir_jax.search.cpu_sr`) gathers every candidate from it.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np

from cfir_jax.core import progress as progress_bars
from cfir_jax.core.errors import CfirError
from cfir_jax.stores.contract import atomic_dir, check_manifest, read_manifest, write_manifest

COMPACT_KIND = "sr_compact"
COMPACT_VERSION = 2  # 2: per-dimension scales [r] (1 had per-row scales [N])


@dataclasses.dataclass
class CompactCache:
    """The compact scoring copy of an image cache.

    rotation [D, r] float32 (orthonormal columns), codes [N, r] int8, scales [r] float32 (one per compact dim):
    row n ~= (codes[n] * scales) @ rotation.T. Per-dimension rather than per-row scales: the scale folds into the
    rotated query, so scoring gathers only the code rows (a per-row scale is one more random memory access per
    candidate, ~18% of the gather), and top-1000 recall measured the same as with per-row scales.
    """

    rotation: np.ndarray
    codes: np.ndarray
    scales: np.ndarray

    @property
    def dims(self) -> int:
        return self.codes.shape[1]

    def query(self, query: np.ndarray) -> np.ndarray:
        """query [D] -> [r] float32 weights with codes[n] @ weights ~= cache[n] @ query."""
        return np.ascontiguousarray((np.asarray(query, np.float32) @ self.rotation) * self.scales, dtype=np.float32)

    @classmethod
    def open(cls, directory: str | os.PathLike, expect_n: int | None = None, expect_dim: int | None = None,
             expect_cache: str | None = None, expect_dims: int | None = None):
        """Memory-maps the codes of a directory written by `build_compact`; StoreError if it is for another cache.

        expect_cache: the cache's `content_fingerprint`; a copy of another cache of the same shape (the cache
        rebuilt by another model) is refused, not silently scored with stale codes.
        """
        manifest = read_manifest(directory, COMPACT_KIND, COMPACT_VERSION)
        expected = dict(n=expect_n, dim=expect_dim, cache_fingerprint=expect_cache, dims=expect_dims)
        expected = {key: v for key, v in expected.items() if v is not None}
        check_manifest(manifest, directory, **expected)
        d = Path(directory)
        return cls(
            rotation=np.load(d / "rotation.npy"),
            codes=np.load(d / "codes.npy", mmap_mode="r"),
            scales=np.load(d / "scales.npy"),
        )


def _fit(cache: np.ndarray, dims: int, sample: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Rotation [D, dims] (top eigenvectors of the uncentered second moment of a row sample) and scales [dims]."""
    n = cache.shape[0]
    rows = np.sort(np.random.default_rng(seed).choice(n, size=min(sample, n), replace=False))
    x = np.asarray(cache[rows], dtype=np.float64)
    # Uncentered: we approximate q . x, not x - mean, so the mean direction must stay in the basis.
    _, vecs = np.linalg.eigh(x.T @ x)
    rotation = np.ascontiguousarray(vecs[:, ::-1][:, :dims], dtype=np.float32)
    # Each dim's largest magnitude in the sample maps to 127; rarer larger values outside the sample clip.
    amax = np.abs(x.astype(np.float32) @ rotation).max(axis=0)
    scales = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    return rotation, scales


def quantize_rows(rotated: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """rotated [n, r] float32, scales [r] -> codes [n, r] int8 (symmetric, clipped to +-127)."""
    return np.clip(np.rint(rotated / scales), -127, 127).astype(np.int8)


def build_compact(
    cache: np.ndarray,
    out_path: str | os.PathLike,
    dims: int = 128,
    sample: int = 100_000,
    chunk_rows: int = 65536,
    seed: int = 0,
    progress: bool = False,
    cache_fingerprint: str | None = None,
) -> CompactCache:
    """Builds the compact scoring copy of cache [N, D] (f16/f32, memmap fine) into directory `out_path`.

    Writes rotation.npy [D, dims] f32, codes.npy [N, dims] int8, scales.npy [dims] f32 and a manifest, atomically;
    the manifest records `cache_fingerprint` (the source cache's `content_fingerprint`) for `CompactCache.open`.
    """
    if cache.ndim != 2 or cache.shape[0] == 0:
        raise CfirError(f"build_compact: cache must be a non-empty [N, D] matrix, got shape {cache.shape}")
    n, dim = cache.shape
    if not 1 <= dims <= dim:
        raise CfirError(f"build_compact: dims={dims} must be in [1, {dim}] (the cache dim)")
    # A damaged cache (NaN or inf rows) yields NaN codes here, quietly: retrieval's score checks refuse such a store
    # in one line naming it (and index.py --verify finds the rows), instead of numpy printing warnings first.
    with np.errstate(invalid="ignore", over="ignore"):
        return _build(cache, out_path, dims, sample, chunk_rows, seed, progress, cache_fingerprint)


def _build(cache, out_path, dims, sample, chunk_rows, seed, progress, cache_fingerprint) -> CompactCache:
    n, dim = cache.shape
    rotation, scales = _fit(cache, dims, sample, seed)
    with atomic_dir(out_path) as tmp:
        np.save(tmp / "rotation.npy", rotation)
        np.save(tmp / "scales.npy", scales)
        codes = np.lib.format.open_memmap(tmp / "codes.npy", mode="w+", dtype=np.int8, shape=(n, dims))
        for start in progress_bars.bar(range(0, n, chunk_rows), desc="compact cache", show=None if progress else False):
            block = np.asarray(cache[start : start + chunk_rows], dtype=np.float32)
            codes[start : start + len(block)] = quantize_rows(block @ rotation, scales)
        codes.flush()
        del codes
        write_manifest(tmp, COMPACT_KIND, COMPACT_VERSION, n=n, dim=dim, dims=dims, sample=min(sample, n),
                       cache_fingerprint=cache_fingerprint)
    return CompactCache.open(out_path)


def compact_in_memory(cache: np.ndarray, dims: int = 128, sample: int = 100_000, seed: int = 0) -> CompactCache:
    """The same representation as `build_compact`, kept in memory (tests, small caches)."""
    rotation, scales = _fit(cache, dims, sample, seed)
    return CompactCache(rotation, quantize_rows(np.asarray(cache, dtype=np.float32) @ rotation, scales), scales)
