"""Approximate nearest-neighbour search by dot product with ScaNN, and its recall against exact search.

The image cache holds millions of L2-normalised rows ([N, D], float16 or float32, often a np.memmap). Exact search
is the search layer's (`cfir_jax.search.topk.exact_topk`: fixed-size blocks, each a jitted matmul + top-k merged into
a running top-k). ScaNN (partitioning tree + anisotropic asymmetric hashing + exact reordering) is the fast path;
`recall_at_k` measures it against the exact answer.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import numpy as np

from cfir_jax.core.errors import CfirError
from cfir_jax.search.topk import RowSubset, best_first, exact_topk


def recall_at_k(approx_indices: np.ndarray, exact_indices: np.ndarray) -> float:
    """Mean fraction of each row of exact_indices [Q, k] found in the same row of approx_indices [Q, k']."""
    approx_indices = np.asarray(approx_indices)
    exact_indices = np.asarray(exact_indices)
    if approx_indices.shape[0] != exact_indices.shape[0]:
        raise CfirError(f"recall_at_k: {approx_indices.shape[0]} approximate rows vs {exact_indices.shape[0]} exact")
    if exact_indices.size == 0:
        return 1.0
    hits = [np.intersect1d(a, e).size for a, e in zip(approx_indices, exact_indices)]
    return float(np.sum(hits) / exact_indices.size)


@dataclasses.dataclass
class ScannConfig:
    """ScaNN settings; None fields are derived from the database size N and k by `resolved`.

    num_leaves ~ sqrt(N); a fifth of them searched, more where that holds fewer than 1.5x the reorder count;
    reorder = max(4k, 1000): on clustered 768-d data the reorder count, not the leaves, is what limits recall.
    dims_per_block 2 and the anisotropic threshold 0.2 (the ScaNN paper's value for unit-norm data) are kept. The
    recall and speed these defaults reach are in the README (benchmarks/index_throughput.py).
    """

    num_leaves: int | None = None
    num_leaves_to_search: int | None = None
    training_sample_size: int | None = None
    dims_per_block: int = 2
    anisotropic_quantization_threshold: float = 0.2
    reorder: int | None = None
    # Below this many rows a tree partition does not pay off: AH over the whole database, then reorder.
    min_rows_for_tree: int = 2000

    def resolved(self, n: int, k: int) -> ScannConfig:
        """Returns a copy with every None field filled for a database of n rows searched for k neighbours."""
        reorder = self.reorder if self.reorder is not None else min(n, max(4 * k, 1000))
        leaves = self.num_leaves if self.num_leaves is not None else max(1, int(math.sqrt(n)))
        leaves = min(leaves, max(1, n // 50))
        if self.num_leaves_to_search is not None:
            search = self.num_leaves_to_search
        else:
            # A fifth of the leaves (partition recall on clustered data), and enough leaves to hold 1.5x the reorder
            # candidates: large K (a tenth of the database) needs a third of the leaves for recall >= 0.95.
            search = max(math.ceil(leaves / 5), math.ceil(1.5 * reorder * leaves / n))
        search = min(search, leaves)
        sample = self.training_sample_size if self.training_sample_size is not None else min(n, 100_000)
        return dataclasses.replace(
            self, num_leaves=leaves, num_leaves_to_search=search, training_sample_size=min(sample, n), reorder=reorder
        )


class ScannSearcher:
    """A ScaNN searcher over a [N, D] database by dot product; `search` returns the same layout as exact_topk."""

    def __init__(self, searcher, config: ScannConfig, n: int, dim: int):
        self._searcher = searcher
        self.config = config
        self.n = n
        self.dim = dim

    @classmethod
    def build(cls, database: np.ndarray, k: int, config: ScannConfig | None = None) -> ScannSearcher:
        """Trains the tree and the quantiser on database [N, D] (converted to float32 in memory: N*D*4 bytes)."""
        # why: ScaNN loads only when a searcher is built or opened (it is absent on some platforms)
        import scann  # Imported here: loading ScaNN's ops costs a second that exact-only callers need not pay.

        if database.ndim != 2 or database.shape[0] == 0:
            raise CfirError(f"ScaNN database must be a non-empty [N, D] matrix, got shape {database.shape}")
        n, dim = database.shape
        config = (config or ScannConfig()).resolved(n, k)
        db = np.ascontiguousarray(database, dtype=np.float32)
        builder = scann.scann_ops_pybind.builder(db, min(k, n), "dot_product")
        if n >= config.min_rows_for_tree and config.num_leaves > 1:
            builder = builder.tree(
                num_leaves=config.num_leaves,
                num_leaves_to_search=config.num_leaves_to_search,
                training_sample_size=config.training_sample_size,
            )
        builder = builder.score_ah(
            config.dims_per_block,
            anisotropic_quantization_threshold=config.anisotropic_quantization_threshold,
            training_sample_size=config.training_sample_size,
        )
        searcher = builder.reorder(config.reorder).build()
        return cls(searcher, config, n, dim)

    def search(self, queries: np.ndarray, k: int, batch_size: int = 256) -> tuple[np.ndarray, np.ndarray]:
        """queries [Q, D] -> (scores [Q, k] float32, indices [Q, k] int32), best first; k is clamped to N.

        A row with fewer than k neighbours found ends in padding: id -1, score -inf (see `drop_padding`).
        """
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        if queries.ndim != 2 or queries.shape[1] != self.dim:
            raise CfirError(f"ScaNN queries must be [Q, {self.dim}], got shape {queries.shape}")
        k = min(int(k), self.n)
        if queries.shape[0] == 0:
            return np.zeros((0, k), np.float32), np.zeros((0, k), np.int32)
        idx, scores = self._searcher.search_batched_parallel(
            queries,
            final_num_neighbors=k,
            pre_reorder_num_neighbors=max(k, self.config.reorder),
            batch_size=batch_size,
        )
        # ScaNN returns fewer than k neighbours when the searched leaves hold fewer points. It pads those rows with
        # id 0 and a NaN distance (a real image id!), or returns a narrower array: both become id -1 / score -inf
        # here, at the end of the row, so callers can drop them (`drop_padding`).
        idx = np.asarray(idx, np.int64)
        scores = np.asarray(scores, np.float32)
        missing = ~np.isfinite(scores)
        idx[missing], scores[missing] = -1, -np.inf
        if idx.shape[1] < k:
            pad = k - idx.shape[1]
            idx = np.pad(idx, ((0, 0), (0, pad)), constant_values=-1)
            scores = np.pad(scores, ((0, 0), (0, pad)), constant_values=-np.inf)
        return scores, idx.astype(np.int32)

    def serialize(self, directory: str | os.PathLike) -> None:
        """Writes the searcher's assets into `directory` with relative paths, so the directory may be moved."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._searcher.serialize(str(directory), relative_path=True)
        cfg = dataclasses.asdict(self.config) | {"n": self.n, "dim": self.dim}
        (directory / "cfir_scann.json").write_text(json.dumps(cfg))

    @classmethod
    def load(cls, directory: str | os.PathLike) -> ScannSearcher:
        """Loads a searcher written by `serialize`; a missing or partial directory raises CfirError."""
        # why: ScaNN loads only when a searcher is built or opened (it is absent on some platforms)
        import scann

        directory = Path(directory)
        meta = directory / "cfir_scann.json"
        if not meta.is_file() or not (directory / "scann_assets.pbtxt").is_file():
            raise CfirError(f"{directory}: no serialized ScaNN searcher here; rebuild the index with backend=scann")
        cfg = json.loads(meta.read_text())
        n, dim = cfg.pop("n"), cfg.pop("dim")
        searcher = scann.scann_ops_pybind.load_searcher(str(directory))
        return cls(searcher, ScannConfig(**cfg), n, dim)


def search_with_tail(searcher: ScannSearcher, database: np.ndarray, queries: np.ndarray, k: int,
                     removed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Top-k of queries [Q, D] over every live row of database [N, D]: the ScaNN tree over the rows it was built on,
    [0, searcher.n), and exact search over the rows appended since, [searcher.n, N), merged best first (ties to the
    lower row). removed: bool [N] rows never returned (ScaNN over-fetches by the removed rows in its range, then
    drops them). Returns the layout of `ScannSearcher.search`: (scores [Q, k], ids [Q, k] int32), padded -inf / -1.
    """
    queries = np.asarray(queries, np.float32)
    n, covered = database.shape[0], min(searcher.n, database.shape[0])
    removed = np.zeros(n, bool) if removed is None else np.asarray(removed, bool)
    k = min(int(k), n)
    s, i = searcher.search(queries, min(covered, k + int(removed[:covered].sum())))
    dead = (i >= 0) & removed[np.maximum(i, 0)]
    i, s = np.where(dead, -1, i), np.where(dead, -np.inf, s)
    tail = np.flatnonzero(~removed[covered:]) + covered
    if len(tail) and len(queries):
        # A contiguous tail is read as a slice of the (memory-mapped) cache; with removed rows, as a gather.
        rows = database[covered:] if len(tail) == n - covered else RowSubset(database, tail)
        ts, ti = exact_topk(queries, rows, min(k, len(tail)))
        s, i = np.concatenate([s, ts], axis=1), np.concatenate([i, tail[ti].astype(np.int32)], axis=1)
    order = best_first(s, i, k)  # padding (-1, -inf) last
    s, i = np.take_along_axis(s, order, 1), np.take_along_axis(i, order, 1)
    if i.shape[1] < k:
        s = np.pad(s, ((0, 0), (0, k - i.shape[1])), constant_values=-np.inf)
        i = np.pad(i, ((0, 0), (0, k - i.shape[1])), constant_values=-1)
    return s.astype(np.float32), i.astype(np.int32)


def drop_padding(indices: np.ndarray) -> list[np.ndarray]:
    """Rows of a padded search result [Q, k] (padding id -1) as a ragged list of int32 [k_i] id arrays."""
    return [np.asarray(row[row >= 0], np.int32) for row in np.asarray(indices)]


def synthetic_embeddings(
    n: int, dim: int, clusters: int = 256, noise: float = 0.6, seed: int = 0, dtype=np.float32, chunk: int = 262144
) -> np.ndarray:
    """Clustered, L2-normalised rows [n, dim] with a decaying spectrum, like real image embeddings.

    Tests and benchmarks use it instead of uniform noise, where every neighbour is equally far and recall means
    little. Cluster centres and noise both fall off as 1/sqrt(1 + i) across dimensions; generated in chunks with
    a float32 RNG so 4M x 768 takes seconds, not minutes.
    """
    rng = np.random.default_rng(seed)
    spectrum = (1.0 / np.sqrt(1.0 + np.arange(dim))).astype(np.float32)
    centres = rng.standard_normal((clusters, dim), dtype=np.float32) * spectrum
    out = np.empty((n, dim), dtype)
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        x = rng.standard_normal((m, dim), dtype=np.float32)
        x *= noise * spectrum
        x += centres[rng.integers(0, clusters, m)]
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        out[start : start + m] = x
    return out
