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
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cfir_jax.errors import CfirError

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
        jdtype = _DTYPES[dtype]
        nbytes = embeddings.shape[0] * embeddings.shape[1] * jnp.dtype(jdtype).itemsize
        if shard is None:
            shard = len(devices) > 1 and not _fits_one_device(nbytes, devices[0])
        self._lay_out(embeddings.shape, k, devices if shard else devices[:1], buckets, query_batch)
        self.cache = self._put(embeddings, jdtype)

    @classmethod
    def from_shapes(cls, n: int, dim: int, k: int = 1000, dtype: str = "float16", devices=None,
                    buckets: tuple[int, ...] = DEFAULT_BUCKETS, query_batch: int = DEFAULT_QUERY_BATCH) -> DeviceCache:
        """A cache of n x dim rows known by shape alone, row-sharded over `devices` (a TPU topology's, for
        compile-only): `cache` is an abstract jax.ShapeDtypeStruct; `lower_sr` / `lower_full` lower its programs."""
        if n < 1 or dim < 1 or dtype not in _DTYPES:
            raise CfirError(f"device cache from shapes needs n, dim >= 1 and float16/bfloat16, got {n}, {dim}, {dtype}")
        self = cls.__new__(cls)
        self._lay_out((n, dim), k, list(devices if devices is not None else jax.local_devices()), buckets, query_batch)
        sharding = NamedSharding(self.mesh, P(AXIS, None))
        self.cache = jax.ShapeDtypeStruct((self.rows_per_shard * self.shards, dim), _DTYPES[dtype], sharding=sharding)
        return self

    def _lay_out(self, shape: tuple[int, int], k: int, devices: list, buckets: tuple[int, ...],
                 query_batch: int) -> None:
        self.n, self.dim = int(shape[0]), int(shape[1])
        self.k, self.buckets, self.query_batch = int(k), tuple(int(b) for b in buckets), int(query_batch)
        self.mesh = Mesh(np.array(devices), (AXIS,))
        self.shards = self.mesh.size
        # Equal row ranges per shard (the last padded with zero rows, never referenced).
        self.rows_per_shard = math.ceil(self.n / self.shards)
        self.block = min(FULL_SEARCH_BLOCK, self.rows_per_shard)
        self.traces = 0  # compilations of the SR function (counted at trace time; tests prove buckets reuse them)
        self._sr = jax.jit(self._sr_impl)
        self._full = jax.jit(self._full_impl, static_argnames="k")

    def _abstract(self, *shapes_dtypes) -> list[jax.ShapeDtypeStruct]:
        """The resident cache and replicated arguments of the given (shape, dtype), as abstract values."""
        replicated = NamedSharding(self.mesh, P())
        cache = jax.ShapeDtypeStruct(self.cache.shape, self.cache.dtype, sharding=self.cache.sharding)
        return [cache] + [jax.ShapeDtypeStruct(s, d, sharding=replicated) for s, d in shapes_dtypes]

    def lower_sr(self, num_queries: int, bucket: int) -> jax.stages.Lowered:
        """The SR program for `num_queries` queries with unions padded to `bucket`, lowered (not run)."""
        return self._sr.lower(*self._abstract(((num_queries, self.dim), jnp.float32),
                                              ((num_queries, bucket), jnp.int32)))

    def lower_full(self, num_queries: int, k: int) -> jax.stages.Lowered:
        """The exact full-cache top-k program (entity top-K, unseen entities) for `num_queries` queries, lowered."""
        return self._full.lower(*self._abstract(((num_queries, self.dim), jnp.float32)), k=k)

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
        """cache (self.cache, an argument: closed over, XLA would embed it as a constant), queries [Q, D] f32,
        ids [Q, B] int32 (sorted, -1 = padding) -> (scores, rows) [Q, min(k, B)]."""
        self.traces += 1
        kk = min(self.k, ids.shape[1])
        r = self.rows_per_shard

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

        shard_s, shard_i = jax.shard_map(local, mesh=self.mesh, in_specs=(P(AXIS, None), P(), P()),
                                         out_specs=(P(AXIS), P(AXIS)))(cache, queries, ids)
        # [S, Q, kk] -> [Q, S * kk], shard 0 first: on equal scores top_k keeps the lower position = the lower row.
        q = queries.shape[0]
        all_s = shard_s.transpose(1, 0, 2).reshape(q, -1)
        all_i = shard_i.transpose(1, 0, 2).reshape(q, -1)
        top_s, pos = jax.lax.top_k(all_s, kk)
        return top_s, jnp.take_along_axis(all_i, pos, axis=1)

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
        """Exact top-k of queries [Q, D] over every row of cache (self.cache): (scores, rows) [Q, k]."""
        r, blk, n = self.rows_per_shard, self.block, self.n
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
                all_s = jnp.concatenate([best[0], bs], axis=1)
                all_i = jnp.concatenate([best[1], rows[bp]], axis=1)
                ts, tp = jax.lax.top_k(all_s, k)
                return (ts, jnp.take_along_axis(all_i, tp, axis=1)), None

            (s, i), _ = jax.lax.scan(step, init, jnp.arange(-(-r // blk), dtype=jnp.int32))
            return s[None], i[None]

        shard_s, shard_i = jax.shard_map(local, mesh=self.mesh, in_specs=(P(AXIS, None), P()),
                                         out_specs=(P(AXIS), P(AXIS)))(cache, queries)
        q = queries.shape[0]
        top_s, pos = jax.lax.top_k(shard_s.transpose(1, 0, 2).reshape(q, -1), k)
        return top_s, jnp.take_along_axis(shard_i.transpose(1, 0, 2).reshape(q, -1), pos, axis=1)

    def full_topk(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Exact top-k over the whole cache: queries [Q, D] -> (scores [Q, k'], rows [Q, k'] int32), k' = min(k, N)."""
        queries = np.asarray(queries, np.float32)
        if queries.ndim != 2 or queries.shape[1] != self.dim:
            raise CfirError(f"full search: queries must be [Q, {self.dim}], got {queries.shape}")
        k = min(int(k), self.n)
        if k < 1:
            raise CfirError(f"k={k} must be >= 1")
        qb = _query_block(len(queries))
        out_s = np.empty((len(queries), k), np.float32)
        out_i = np.empty((len(queries), k), np.int32)
        replicated = NamedSharding(self.mesh, P())
        for q0 in range(0, len(queries), qb):
            q = np.zeros((qb, self.dim), np.float32)
            part = queries[q0 : q0 + qb]
            q[: len(part)] = part
            s, i = self._full(self.cache, jax.device_put(q, replicated), k=k)
            out_s[q0 : q0 + len(part)] = np.asarray(s)[: len(part)]
            out_i[q0 : q0 + len(part)] = np.asarray(i)[: len(part)]
        return out_s, out_i


def _query_block(n: int) -> int:
    """Queries per full-search call: the next power of two up to 256 (a few shapes, few compilations)."""
    return min(256, 1 << max(0, math.ceil(math.log2(max(1, n)))))
