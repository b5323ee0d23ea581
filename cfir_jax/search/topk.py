"""Exact top-k by dot product, written once: over a candidate set (numpy) and over the whole cache (jitted blocks).

`exact_top_k(cache, query, ids, k)` is the paper's SR: every candidate row ids [M] gathered (float16 cast to
float32 by `cast_f16`) and scored in float32, top-k by argpartition. `exact_topk(queries, database, k)` searches
every row of a host array (a np.memmap is read one block at a time) through one jitted block step, `merge_block`,
whose running top-k is merged by `merge_top_k`; the device-resident cache (`cfir_jax.search.device_sr`) merges its
blocks and shards with the same `merge_top_k`. Neither ever materialises a [Q, N] score matrix. Ties go to the lower
row everywhere (positions follow row order and `jax.lax.top_k` keeps the lower position); `best_first` orders any
(score, row) pairs by that rule.
"""

from __future__ import annotations

import functools
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

from cfir_jax.core.errors import CfirError

DEFAULT_BLOCK_SIZE = 32768
DEFAULT_QUERY_BLOCK = 256
_ROW_GROUP = 16  # rows per BLAS group in `_row_scores`
# float16 bit pattern -> float32 value (256 KiB, stays in L2): numpy's own astype is a scalar loop. `cast_f16` takes it
# where its integer passes cannot be exact: a chunk holding an infinity or a NaN (a damaged row), whose bits it keeps as
# numpy's astype does, a thread that reads subnormal inputs as zero, and a dst that overlaps its src.
_F16_TO_F32 = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
# float16's 15 bits below the sign, shifted left 13, are a float32 whose exponent is 112 too small: bit 31 keeps the
# sign (an int16 sign-extends into bits 31-28) and bits 30-28 are cleared; one multiply by 2**112 rebiases the exponent
# and normalises a subnormal, exactly. An infinity or a NaN (exponent all ones) lands at 65536 or above in magnitude.
_SIGN_AND_LOW_28 = np.int32(-0x70000001)  # 0x8FFFFFFF as int32
_REBIAS = np.float32(2.0**112)
_SPECIAL = 65536.0
# The smallest float32 subnormal: times 2**112 it is 0 on a thread whose CPU reads subnormal inputs as zero (DAZ: XLA
# sets it while a jitted computation runs, so inside a host callback), where the multiply would zero float16's 2,046
# subnormals.
_SUBNORMAL = np.array([1e-45], np.float32)
# torch parallelises copies above 32,768 elements (and its pool then fights the scorer's own threads: 1000x slower
# under load); casting at most that many values at a time keeps it on the calling thread without touching torch's
# process-wide thread setting, whatever the row width (768, or 1536 for fused rows).
_TORCH_CAST_VALUES = 32768


def _torch():
    """torch where this process has loaded it already (optional: a faster float16 -> float32 cast), else None. It is
    never imported for the cast: its import costs a command's start seconds (a JAX user's included, where torch is
    merely installed), for a cast of milliseconds."""
    return sys.modules.get("torch")


def cast_f16(src: np.ndarray, dst: np.ndarray) -> None:
    """dst[...] = src (float16 -> float32, the same shape), bit for bit numpy's astype, vectorised: torch's F16C loop
    if loaded, else four integer and float passes of numpy and a min/max check (2.7x the lookup table's speed,
    `benchmarks/f16_cast.py`), or the lookup table where the passes cannot be exact (see `_F16_TO_F32`)."""
    if src.shape != dst.shape:
        raise ValueError(f"cast_f16: src {src.shape} and dst {dst.shape} differ")
    torch = _torch()
    if torch is None:
        if np.may_share_memory(src, dst) or not np.multiply(_SUBNORMAL, _REBIAS)[0]:
            np.take(_F16_TO_F32, src.view(np.uint16), out=dst)
            return
        bits = dst.view(np.int32)
        np.copyto(bits, src.view(np.int16))  # sign-extended
        np.left_shift(bits, 13, out=bits)
        np.bitwise_and(bits, _SIGN_AND_LOW_28, out=bits)
        np.multiply(dst, _REBIAS, out=dst)
        if dst.size and (dst.max() >= _SPECIAL or dst.min() <= -_SPECIAL):
            np.take(_F16_TO_F32, src.view(np.uint16), out=dst)
        return
    step = max(1, _TORCH_CAST_VALUES // max(1, src.shape[-1]))
    for a in range(0, len(src), step):
        torch.from_numpy(dst[a : a + step]).copy_(torch.from_numpy(src[a : a + step]))


def unique_sorted(candidates: np.ndarray) -> np.ndarray:
    """Sorted unique ids of candidates [M] int32; a sort is ~20x faster than np.unique here and aids locality."""
    s = np.sort(np.asarray(candidates, dtype=np.int32))
    if s.size == 0:
        return s
    keep = np.empty(s.size, np.bool_)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


def best_first(scores: np.ndarray, rows: np.ndarray, k: int | None = None) -> np.ndarray:
    """Positions of (score, row) pairs along the last axis, best first: by score descending, ties to the lower row,
    padding (row < 0) after every real row of its score; the first k when k is given. The tie rule of every top-k on
    the host: BM25, the cluster's merge of its shards, the entity-only ranking, ScaNN with its exact tail."""
    rows = np.asarray(rows)
    key = np.where(rows < 0, np.iinfo(np.int64).max, rows.astype(np.int64)) if rows.size and rows.min() < 0 else rows
    order = np.lexsort((key, -np.asarray(scores)), axis=-1)
    return order if k is None else order[..., :k]


def top_k_positions(scores: np.ndarray, k: int) -> np.ndarray:
    """Positions of the k best of scores [S], best first, ties to the lower position: in the order, and at the cut
    (argpartition keeps tied positions in no particular order, and picks any of those tied at the k-th score)."""
    if scores.size > k:
        part = np.argpartition(scores, scores.size - k)[scores.size - k :]
        cut = scores[part].min()
        if cut == cut:  # NaN sorts as the largest: a damaged row's score stays in, for check_scores to refuse
            above = np.flatnonzero(scores > cut)
            part = np.concatenate([above, np.flatnonzero(scores == cut)[: k - above.size]])
    else:
        part = np.arange(scores.size)
    return part[np.lexsort((part, -scores[part]))]


def exact_top_k(cache: np.ndarray, query: np.ndarray, ids: np.ndarray, k: int,
                chunk_rows: int = 8192) -> tuple[np.ndarray, np.ndarray]:
    """The paper's SR: float32 dot products of every cache row ids [M] with query [D]; (scores [k'], ids [k'] int32),
    best first, k' = min(k, M). Gathered in chunks so a 55k-candidate union never holds 170 MB of float32 at once."""
    ids = np.asarray(ids)
    scores = exact_scores(cache, query, ids, chunk_rows)
    best = top_k_positions(scores, k)
    return scores[best], ids[best].astype(np.int32)


def exact_scores(cache: np.ndarray, query: np.ndarray, ids: np.ndarray, chunk_rows: int = 8192) -> np.ndarray:
    """float32 [M]: the dot product of each cache row ids [M] with query [D], as `exact_top_k` scores it."""
    ids = np.asarray(ids)
    query = np.asarray(query, np.float32)
    scores = np.empty(ids.size, np.float32)
    for a in range(0, ids.size, chunk_rows):
        rows = np.asarray(cache[ids[a : a + chunk_rows]])
        if rows.dtype == np.float16:  # numpy's own float16 -> float32 cast is a scalar loop (~10x slower)
            wide = np.empty(rows.shape, np.float32)
            cast_f16(rows, wide)
            rows = wide
        scores[a : a + chunk_rows] = _row_scores(np.asarray(rows, np.float32), query)
    return scores


def _row_scores(rows: np.ndarray, query: np.ndarray) -> np.ndarray:
    """rows [m, D] @ query [D], each row's score independent of m and of the other rows: BLAS computes the rows past
    the last full group of a matrix-vector product another way (1 ulp apart), so the rows are padded to a multiple
    of _ROW_GROUP. A candidate's score is then the same in any union, on any shard."""
    pad = -len(rows) % _ROW_GROUP
    if pad:
        rows = np.concatenate([rows, np.zeros((pad, rows.shape[1]), np.float32)])
    return (rows @ query)[: len(rows) - pad]


class RowSubset:
    """Rows `rows` [V] (sorted int64 ids) of a database [N, D], as a [V, D] array to `exact_topk`: a slice gathers
    only those rows, so a search over a candidate union reads V rows, never N. Result positions p map back to
    database rows by `rows[p]`; sorted ids keep the lower row first on ties, as over the whole database."""

    def __init__(self, database: np.ndarray, rows: np.ndarray):
        self.database, self.rows = database, np.asarray(rows, np.int64)
        self.shape, self.dtype, self.ndim = (len(self.rows), database.shape[1]), database.dtype, 2

    def __getitem__(self, s: slice) -> np.ndarray:
        return np.asarray(self.database[self.rows[s]])


# ---------------------------------------------------------------------------------------------- jitted, whole cache
def query_rows(n: int, most: int = DEFAULT_QUERY_BLOCK) -> int:
    """Queries per whole-cache search call: the next power of two up to `most` (a few shapes, few compilations)."""
    return min(most, 1 << max(0, math.ceil(math.log2(max(1, n)))))


def merge_top_k(best_scores: jax.Array, best_rows: jax.Array, scores: jax.Array, rows: jax.Array, k: int
                ) -> tuple[jax.Array, jax.Array]:
    """A running top-k [Q, k] and a block's candidates [Q, b] -> the top-k of both; the running list (lower rows)
    goes first, so ties keep the lower row."""
    all_s = jnp.concatenate([best_scores, scores], axis=1)
    all_i = jnp.concatenate([best_rows, rows], axis=1)
    top_s, pos = jax.lax.top_k(all_s, k)
    return top_s, jnp.take_along_axis(all_i, pos, axis=1)


@functools.partial(jax.jit, static_argnames=("k",), donate_argnums=(3, 4))
def merge_block(queries, block, n_valid, best_scores, best_idx, offset, *, k):
    """One database block into the running top-k.

    queries [q, D] f32, block [B, D] (f16/f32; rows >= n_valid are padding), best_* [q, k], offset: first row id.
    """
    scores = jnp.dot(queries, block.astype(jnp.float32).T, precision=jax.lax.Precision.HIGHEST)
    valid = jnp.arange(block.shape[0]) < n_valid
    scores = jnp.where(valid[None, :], scores, -jnp.inf)
    kb = min(k, block.shape[0])
    s, i = jax.lax.top_k(scores, kb)
    return merge_top_k(best_scores, best_idx, s, i.astype(jnp.int32) + offset, k)


def _check_pair(queries: np.ndarray, database: np.ndarray) -> None:
    if queries.ndim != 2 or database.ndim != 2:
        raise CfirError(f"queries {queries.shape} and database {database.shape} must both be [rows, dim] matrices")
    if queries.shape[1] != database.shape[1]:
        raise CfirError(
            f"query dim {queries.shape[1]} != database dim {database.shape[1]}; embed both with the same model"
        )
    if database.shape[0] == 0:
        raise CfirError("database is empty (0 rows); build the image cache first")


def exact_topk(
    queries: np.ndarray,
    database: np.ndarray,
    k: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    query_block: int = DEFAULT_QUERY_BLOCK,
    fixed_block: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k by dot product over every row of a host array.

    queries [Q, D] float32; database [N, D] float16/float32 (np.memmap or a `RowSubset` is fine: read one block at a
    time). Returns (scores [Q, k] float32, indices [Q, k] int32), best first; k is clamped to N.
    fixed_block: blocks of block_size rows even when N is smaller (the one block padded), so a subset of a larger
    database is scored with that database's matmul shapes (an update that must equal a from-scratch search).
    """
    queries = np.asarray(queries, dtype=np.float32)
    _check_pair(queries, database)
    n = database.shape[0]
    k = min(int(k), n)
    if k < 1:
        raise CfirError(f"k={k} must be >= 1")
    # Fixed shapes: every block is block_size rows and every query chunk qb rows, so one compilation serves all.
    block_size = block_size if fixed_block else min(block_size, n)
    qb = query_rows(queries.shape[0], query_block)
    out_s = np.empty((queries.shape[0], k), np.float32)
    out_i = np.empty((queries.shape[0], k), np.int32)
    for q0 in range(0, queries.shape[0], qb):
        q = queries[q0 : q0 + qb]
        nq = q.shape[0]
        if nq < qb:
            q = np.concatenate([q, np.zeros((qb - nq, q.shape[1]), np.float32)])
        q = jnp.asarray(q)
        best_s = jnp.full((qb, k), -jnp.inf, jnp.float32)
        best_i = jnp.full((qb, k), -1, jnp.int32)
        for b0 in range(0, n, block_size):
            block = np.asarray(database[b0 : b0 + block_size])
            nv = block.shape[0]
            if nv < block_size:
                block = np.concatenate([block, np.zeros((block_size - nv, block.shape[1]), block.dtype)])
            best_s, best_i = merge_block(q, block, np.int32(nv), best_s, best_i, np.int32(b0), k=k)
        out_s[q0 : q0 + nq] = np.asarray(best_s)[:nq]
        out_i[q0 : q0 + nq] = np.asarray(best_i)[:nq]
    return out_s, out_i


class RowRange:
    """Rows [lo, hi) of a database [N, D] (a np.memmap or `FusedRows`) as a [hi - lo, D] array for `exact_topk`,
    which reads it one slice at a time."""

    def __init__(self, database, lo: int, hi: int):
        self.database, self.lo, self.hi = database, lo, hi
        self.shape, self.dtype, self.ndim = (hi - lo, database.shape[1]), database.dtype, 2

    def __len__(self) -> int:
        return self.hi - self.lo

    def __getitem__(self, s: slice) -> np.ndarray:
        start, stop, _ = s.indices(self.hi - self.lo)
        return np.asarray(self.database[self.lo + start : self.lo + stop])


def span_topk(queries: np.ndarray, database, lo: int, hi: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """`exact_topk` over rows [lo, hi) of database [N, D] (a shard's rows), in the whole database's block shape, so
    every score is bit-equal to the whole search's: (scores [Q, k'], rows [Q, k'] numbered as in database)."""
    scores, rows = exact_topk(queries, RowRange(database, lo, hi), min(int(k), hi - lo),
                              block_size=min(DEFAULT_BLOCK_SIZE, database.shape[0]), fixed_block=True)
    return scores, np.where(rows >= 0, rows + lo, -1).astype(np.int32)


def subset_topk(queries: np.ndarray, database, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """`exact_topk` over the rows ids [V] (ascending) of database [N, D] only, in the whole database's block shape,
    so every score is bit-equal to the whole search's and ties still go to the lower row: (scores [Q, k'], rows
    [Q, k'] numbered as in database). A filter's search scores the rows it passes, never the N."""
    ids = np.asarray(ids, np.int64)
    scores, pos = exact_topk(queries, RowSubset(database, ids), min(int(k), len(ids)),
                             block_size=min(DEFAULT_BLOCK_SIZE, database.shape[0]), fixed_block=True)
    return scores, np.where(pos >= 0, ids[np.maximum(pos, 0)], -1).astype(np.int32)
