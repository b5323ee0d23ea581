"""Summary re-ranking on the accelerator: the image cache resident on the local devices and a jitted, batched SR.

The cache [N, D] (float16 or bfloat16) is put on the devices once, row-sharded over a 1-D mesh (axis "rows") when it
does not fit one device (an 11M x 1024 float16 cache is 22 GB) or when asked; otherwise it lives on one device.

SR for a batch of queries: each query's candidate union (sorted unique row ids) is padded with -1 to one of a few
fixed bucket sizes, and the batch to a power of two, so queries of different union sizes reuse one compilation per
(bucket, batch size). Under
`jax.shard_map` every shard gathers the candidates it owns, scores them exactly (rows cast to float32, float32 dot at
HIGHEST precision), masks the rest and the padding to -inf and keeps its top-k; the shards' top-k lists are then
merged into the global top-k. `jax.lax.top_k` breaks ties by position, and positions follow row order (the union is
sorted and shards hold ascending row ranges), so ties go to the lower row.

The same resident cache serves exact search of the whole cache (`full_topk`: entity top-K with the exact backend,
unseen-entity search, the dense baselines), blocked so no [Q, N] score matrix is ever materialised.

Both programs are module-level pure functions of (arrays, static sizes and mesh), `sr_top_k` and `full_top_k`, with
their jitted forms `device_sr` and `device_full_topk`: they lower with `jax.ShapeDtypeStruct` arguments
(`abstract_cache` gives the cache's, sharded) for compiling without the devices. `DeviceCache` holds the resident
array and calls them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cfir_jax.core.errors import CfirError
from cfir_jax.search.topk import merge_top_k, query_rows

AXIS = "rows"
DEFAULT_BUCKETS = (4096, 16384, 65536, 262144)
DEFAULT_QUERY_BATCH = 8
# Rows scored per step of the full search, per shard: [Q, 32768] float32 scores stay small on any device.
FULL_SEARCH_BLOCK = 32768
# Share of one device's memory the cache may take before it is sharded (the rest: gathered rows, scores, the model).
_FIT_FRACTION = 0.5
_DTYPES = {"float16": jnp.float16, "bfloat16": jnp.bfloat16}


def has_accelerator() -> bool:
    """True when JAX's default backend is a GPU or TPU."""
    return jax.default_backend() in ("gpu", "tpu", "cuda", "rocm")


def platform() -> str:
    """The platform JAX computes on ('cpu', 'gpu', 'tpu'): what a report names as the device."""
    return jax.default_backend()


def bucket_size(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= n; past the largest, the next multiple of it (a rare extra compilation)."""
    for b in buckets:
        if n <= b:
            return b
    return buckets[-1] * math.ceil(n / buckets[-1])


def _fits_one_device(nbytes: int, device) -> bool:
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    limit = (stats or {}).get("bytes_limit")
    return limit is None or nbytes <= _FIT_FRACTION * limit


def make_mesh(devices: list, shard: bool) -> Mesh:
    """The 1-D mesh (axis "rows") the cache lives on: every device when sharded, else the first."""
    return Mesh(np.array(devices if shard else devices[:1]), (AXIS,))


def rows_per_shard(n: int, shards: int) -> int:
    """Equal row ranges per shard (the last padded with zero rows, never referenced)."""
    return math.ceil(n / shards)


def abstract_cache(n: int, dim: int, dtype: str, mesh: Mesh) -> jax.ShapeDtypeStruct:
    """The resident cache as a shape alone, with its sharding: what `device_sr` / `device_full_topk` lower against
    when compiling without the devices (or without the cache)."""
    shape = (rows_per_shard(n, mesh.size) * mesh.size, dim)
    return jax.ShapeDtypeStruct(shape, _DTYPES[dtype], sharding=NamedSharding(mesh, P(AXIS, None)))


def sr_top_k(cache: jax.Array, queries: jax.Array, ids: jax.Array, *, k: int, rows_per_shard: int, mesh: Mesh
             ) -> tuple[jax.Array, jax.Array]:
    """Exact SR of padded unions: cache [S * r, D] row-sharded over mesh, queries [Q, D] f32, ids [Q, B] int32
    (sorted, -1 = padding) -> (scores, rows) [Q, min(k, B)]."""
    kk = min(k, ids.shape[1])
    r = rows_per_shard

    def local(cache, q, ids):
        local_ids = ids - jax.lax.axis_index(AXIS) * r
        own = (ids >= 0) & (local_ids >= 0) & (local_ids < r)

        def one(args):
            qi, li, oi = args
            rows = jnp.take(cache, jnp.where(oi, li, 0), axis=0).astype(jnp.float32)  # [B, D]
            s = jnp.dot(rows, qi, precision=jax.lax.Precision.HIGHEST)
            return jnp.where(oi, s, -jnp.inf)

        # One query at a time: a [B, D] float32 gather per query, not [Q, B, D].
        scores = jax.lax.map(one, (q, local_ids, own))  # [Q, B]
        top_s, pos = jax.lax.top_k(scores, kk)
        return top_s[None], jnp.take_along_axis(ids, pos, axis=1)[None]

    shard_s, shard_i = jax.shard_map(local, mesh=mesh, in_specs=(P(AXIS, None), P(), P()),
                                     out_specs=(P(AXIS), P(AXIS)))(cache, queries, ids)
    return _merge_shards(shard_s, shard_i, kk)


def _merge_shards(shard_s: jax.Array, shard_i: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """[S, Q, kk] per-shard lists -> [Q, k], shard 0 first: on equal scores top_k keeps the lower position = row."""
    q = shard_s.shape[1]
    top_s, pos = jax.lax.top_k(shard_s.transpose(1, 0, 2).reshape(q, -1), k)
    return top_s, jnp.take_along_axis(shard_i.transpose(1, 0, 2).reshape(q, -1), pos, axis=1)


def full_top_k(cache: jax.Array, queries: jax.Array, *, k: int, n: int, rows_per_shard: int, block: int, mesh: Mesh
               ) -> tuple[jax.Array, jax.Array]:
    """Exact top-k of queries [Q, D] over the n real rows of cache [S * r, D], in blocks of `block` rows per shard:
    (scores, rows) [Q, k]."""
    r, blk = rows_per_shard, block
    kb = min(k, blk)

    def local(cache, q):
        base = jax.lax.axis_index(AXIS) * r
        init = (jnp.full((q.shape[0], k), -jnp.inf, jnp.float32), jnp.full((q.shape[0], k), -1, jnp.int32))
        # The carry becomes shard-dependent after one block: mark it so from the start (shard_map's vma types).
        init = jax.lax.pcast(init, (AXIS,), to="varying")

        def step(best, i):
            # The last block is slid back to end at row r (no padding to a multiple of blk); its rows that the
            # previous block already scored are masked.
            start = jnp.minimum(i * blk, r - blk)
            block = jax.lax.dynamic_slice_in_dim(cache, start, blk)
            s = jnp.dot(q, block.astype(jnp.float32).T, precision=jax.lax.Precision.HIGHEST)
            local_rows = start + jnp.arange(blk, dtype=jnp.int32)
            rows = base + local_rows
            s = jnp.where((rows[None] < n) & (local_rows[None] >= i * blk), s, -jnp.inf)
            bs, bp = jax.lax.top_k(s, kb)
            # Earlier blocks (lower rows) first: ties keep the lower row.
            return merge_top_k(best[0], best[1], bs, rows[bp], k), None

        (s, i), _ = jax.lax.scan(step, init, jnp.arange(-(-r // blk), dtype=jnp.int32))
        return s[None], i[None]

    shard_s, shard_i = jax.shard_map(local, mesh=mesh, in_specs=(P(AXIS, None), P()),
                                     out_specs=(P(AXIS), P(AXIS)))(cache, queries)
    return _merge_shards(shard_s, shard_i, k)


def subset_top_k(cache: jax.Array, queries: jax.Array, ids: jax.Array, *, k: int, block: int, mesh: Mesh
                 ) -> tuple[jax.Array, jax.Array]:
    """Exact top-k of queries [Q, D] over some rows of cache [S * r, D] only (a filter's passing rows): ids [S, L]
    holds each shard's own rows, numbered within the shard, ascending, -1 after them (L a multiple of `block`,
    sharded over the mesh). Each step gathers `block` of them and scores them in `full_top_k`'s block shape, so
    scores are bit-equal to the whole search's and ties go to the lower row: (scores, cache rows) [Q, k]."""
    blk = block
    kb = min(k, blk)

    def local(cache, q, ids):
        ids = ids[0]
        base = jax.lax.axis_index(AXIS) * cache.shape[0]
        init = (jnp.full((q.shape[0], k), -jnp.inf, jnp.float32), jnp.full((q.shape[0], k), -1, jnp.int32))
        init = jax.lax.pcast(init, (AXIS,), to="varying")

        def step(best, i):
            local_rows = jax.lax.dynamic_slice_in_dim(ids, i * blk, blk)
            valid = local_rows >= 0
            block = jnp.take(cache, jnp.where(valid, local_rows, 0), axis=0)
            s = jnp.dot(q, block.astype(jnp.float32).T, precision=jax.lax.Precision.HIGHEST)
            s = jnp.where(valid[None], s, -jnp.inf)
            rows = jnp.where(valid, base + local_rows, -1)
            bs, bp = jax.lax.top_k(s, kb)
            return merge_top_k(best[0], best[1], bs, rows[bp], k), None

        (s, i), _ = jax.lax.scan(step, init, jnp.arange(ids.shape[0] // blk, dtype=jnp.int32))
        return s[None], i[None]

    shard_s, shard_i = jax.shard_map(local, mesh=mesh, in_specs=(P(AXIS, None), P(), P(AXIS, None)),
                                     out_specs=(P(AXIS), P(AXIS)))(cache, queries, ids)
    return _merge_shards(shard_s, shard_i, k)


def subset_width(most: int, block: int) -> int:
    """The rows per shard `subset_top_k` scans for a shard list of at most `most` rows: `block` times a power of two
    (a few shapes, few compilations; at most twice the rows)."""
    return block * (1 << max(0, math.ceil(math.log2(max(1, -(-most // block))))))


# The jitted programs (static: sizes and the mesh); lower them with ShapeDtypeStruct arguments to compile ahead.
device_sr = jax.jit(sr_top_k, static_argnames=("k", "rows_per_shard", "mesh"))
device_full_topk = jax.jit(full_top_k, static_argnames=("k", "n", "rows_per_shard", "block", "mesh"))
device_subset_topk = jax.jit(subset_top_k, static_argnames=("k", "block", "mesh"))


class DeviceCache:
    """The image cache on the local devices, with batched exact SR and exact full search over it.

    embeddings [N, D] float16/float32 (memmap fine: copied to the devices shard by shard); dtype: the resident dtype
    ("float16" or "bfloat16"); shard: None = only when the cache does not fit one device, True/False to force;
    buckets: union sizes compiled for; query_batch: most queries per SR call (a call's queries are padded with empty
    unions to a power of two); k: results.
    """

    def __init__(
        self,
        embeddings: np.ndarray,
        k: int = 1000,
        dtype: str = "float16",
        shard: bool | None = None,
        devices=None,
        buckets: tuple[int, ...] = DEFAULT_BUCKETS,
        query_batch: int = DEFAULT_QUERY_BATCH,
    ):
        if embeddings.ndim != 2 or embeddings.shape[0] == 0:
            raise CfirError(f"device cache needs a non-empty [N, D] matrix, got shape {embeddings.shape}")
        if dtype not in _DTYPES:
            raise CfirError(f"retrieval.sr_device_dtype={dtype!r}: use float16 or bfloat16")
        if k < 1 or query_batch < 1 or not buckets or list(buckets) != sorted(set(buckets)) or buckets[0] < 1:
            raise CfirError(f"device SR needs k >= 1, query_batch >= 1 and increasing positive buckets; got k={k}, "
                            f"query_batch={query_batch}, buckets={buckets}")
        devices = list(devices if devices is not None else jax.local_devices())
        self.n, self.dim = embeddings.shape
        self.k, self.buckets, self.query_batch = int(k), tuple(int(b) for b in buckets), int(query_batch)
        jdtype = _DTYPES[dtype]
        nbytes = self.n * self.dim * jnp.dtype(jdtype).itemsize
        if shard is None:
            shard = len(devices) > 1 and not _fits_one_device(nbytes, devices[0])
        self.mesh = make_mesh(devices, shard)
        self.shards = self.mesh.size
        self.rows_per_shard = rows_per_shard(self.n, self.shards)
        self.block = min(FULL_SEARCH_BLOCK, self.rows_per_shard)
        self.cache = self._put(embeddings, jdtype)
        self.traces = 0  # compilations of the SR function (counted at trace time; tests prove buckets reuse them)
        # Jitted per cache (its own compilations, counted in `traces`); the same programs as `device_sr` and
        # `device_full_topk`.
        self._sr = jax.jit(self._sr_impl)
        self._full = jax.jit(self._full_impl, static_argnames="k")
        self._subset = jax.jit(self._subset_impl, static_argnames="k")

    def _put(self, embeddings: np.ndarray, jdtype) -> jax.Array:
        """Each device receives only its row range (never the whole cache on one device first)."""
        sharding = NamedSharding(self.mesh, P(AXIS, None))
        shape = (self.rows_per_shard * self.shards, self.dim)
        if self.shards == 1 and isinstance(embeddings, np.ndarray) and embeddings.dtype == jdtype:
            # One device, no padding, no cast: XLA:CPU aliases a 64-byte aligned host array instead of copying it.
            return jax.device_put(embeddings, sharding)

        def shard_rows(index) -> np.ndarray:
            start = index[0].start or 0
            rows = np.zeros((self.rows_per_shard, self.dim), jdtype)
            part = np.asarray(embeddings[start : min(start + self.rows_per_shard, self.n)])
            rows[: len(part)] = part.astype(jdtype)
            return rows

        return jax.make_array_from_callback(shape, sharding, shard_rows)

    # ------------------------------------------------------------------------------------------------------ SR
    def _sr_impl(self, cache: jax.Array, queries: jax.Array, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        """`sr_top_k` over this cache (an argument: closed over, XLA would embed it as a constant)."""
        self.traces += 1
        return sr_top_k(cache, queries, ids, k=self.k, rows_per_shard=self.rows_per_shard, mesh=self.mesh)

    def score_batch(self, queries: np.ndarray, unions: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
        """queries [Q, D], unions: Q sorted unique int row ids each -> per query (scores [k'], rows [k'] int32).

        k' = min(k, union size), best first; grouped by bucket and sent query_batch at a time.
        """
        queries = np.asarray(queries, np.float32)
        if queries.ndim != 2 or queries.shape[1] != self.dim or len(queries) != len(unions):
            raise CfirError(f"device SR: queries must be [{len(unions)}, {self.dim}], got {queries.shape}")
        out: list[tuple[np.ndarray, np.ndarray]] = [(np.zeros(0, np.float32), np.zeros(0, np.int32))] * len(unions)
        sizes = [len(u) for u in unions]
        for u in unions:
            if len(u) and (np.min(u) < 0 or np.max(u) >= self.n):
                raise CfirError(f"candidate ids must be in [0, {self.n}); got {np.min(u)}..{np.max(u)}")
        by_bucket: dict[int, list[int]] = {}
        for i, m in enumerate(sizes):
            if m:
                by_bucket.setdefault(bucket_size(m, self.buckets), []).append(i)
        replicated = NamedSharding(self.mesh, P())
        for b, members in sorted(by_bucket.items()):
            for c in range(0, len(members), self.query_batch):
                chunk = members[c : c + self.query_batch]
                # Padded to a power of two up to query_batch: a few shapes, and a lone query does not pay for 8.
                qpad = min(self.query_batch, 1 << (len(chunk) - 1).bit_length())
                ids = np.full((qpad, b), -1, np.int32)
                q = np.zeros((qpad, self.dim), np.float32)
                for j, i in enumerate(chunk):
                    ids[j, : sizes[i]] = np.sort(unions[i])  # sorted: ties then go to the lower row
                    q[j] = queries[i]
                s, rows = self._sr(self.cache, jax.device_put(q, replicated), jax.device_put(ids, replicated))
                s, rows = np.asarray(s), np.asarray(rows)
                for j, i in enumerate(chunk):
                    kept = min(self.k, sizes[i])
                    out[i] = (s[j, :kept], rows[j, :kept])
        return out

    def score(self, query: np.ndarray, union: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One query [D] and its sorted unique union [M] -> (scores [k'], rows [k'])."""
        return self.score_batch(np.asarray(query, np.float32)[None], [np.asarray(union)])[0]

    # ---------------------------------------------------------------------------------------------- full search
    def _full_impl(self, cache: jax.Array, queries: jax.Array, *, k: int) -> tuple[jax.Array, jax.Array]:
        """`full_top_k` over this cache: queries [Q, D] -> (scores, rows) [Q, k]."""
        return full_top_k(cache, queries, k=k, n=self.n, rows_per_shard=self.rows_per_shard, block=self.block,
                          mesh=self.mesh)

    def full_topk(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Exact top-k over the whole cache: queries [Q, D] -> (scores [Q, k'], rows [Q, k'] int32), k' = min(k, N)."""
        return self._chunked(queries, min(int(k), self.n), "full search", lambda q, k: self._full(self.cache, q, k=k))

    def _chunked(self, queries: np.ndarray, k: int, what: str, call) -> tuple[np.ndarray, np.ndarray]:
        """call(q [qb, D] on the devices, k) over queries [Q, D] in chunks of a few fixed sizes -> [Q, k] each."""
        queries = np.asarray(queries, np.float32)
        if queries.ndim != 2 or queries.shape[1] != self.dim:
            raise CfirError(f"{what}: queries must be [Q, {self.dim}], got {queries.shape}")
        if k < 1:
            raise CfirError(f"{what}: k={k} must be >= 1")
        qb = query_rows(len(queries))
        out_s = np.empty((len(queries), k), np.float32)
        out_i = np.empty((len(queries), k), np.int32)
        replicated = NamedSharding(self.mesh, P())
        for q0 in range(0, len(queries), qb):
            q = np.zeros((qb, self.dim), np.float32)
            part = queries[q0 : q0 + qb]
            q[: len(part)] = part
            s, i = call(jax.device_put(q, replicated), k)
            out_s[q0 : q0 + len(part)] = np.asarray(s)[: len(part)]
            out_i[q0 : q0 + len(part)] = np.asarray(i)[: len(part)]
        return out_s, out_i

    def _subset_impl(self, cache: jax.Array, queries: jax.Array, ids: jax.Array, *, k: int
                     ) -> tuple[jax.Array, jax.Array]:
        """`subset_top_k` over this cache: queries [Q, D], ids [S, L] -> (scores, rows) [Q, k]."""
        return subset_top_k(cache, queries, ids, k=k, block=self.block, mesh=self.mesh)

    def shard_ids(self, rows: np.ndarray) -> np.ndarray:
        """Cache rows [V] (ascending) -> [S, L] int32: each shard's own, numbered within it, -1 after them. L is
        `block` times a power of two, so the rows of any filter fall in a few shapes (few compilations)."""
        rows = np.asarray(rows, np.int64)
        cuts = np.searchsorted(rows, np.arange(self.shards + 1) * self.rows_per_shard)
        ids = np.full((self.shards, subset_width(int(np.diff(cuts).max(initial=0)), self.block)), -1, np.int32)
        for s in range(self.shards):
            own = rows[cuts[s] : cuts[s + 1]] - s * self.rows_per_shard
            ids[s, : len(own)] = own
        return ids

    def subset_topk(self, queries: np.ndarray, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Exact top-k over the rows [V] (ascending) only: queries [Q, D] -> (scores [Q, k'], rows [Q, k'] int32),
        k' = min(k, V); each score bit-equal to `full_topk`'s."""
        ids = jax.device_put(self.shard_ids(rows), NamedSharding(self.mesh, P(AXIS, None)))
        return self._chunked(queries, min(int(k), len(rows)), "subset search",
                             lambda q, k: self._subset(self.cache, q, ids, k=k))
