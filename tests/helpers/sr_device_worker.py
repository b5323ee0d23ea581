"""Device SR checks on 8 fake CPU devices (the device count is fixed per process, so
tests/unit/search/test_sr_device.py runs this file in a subprocess with
XLA_FLAGS=--xla_force_host_platform_device_count=8).

    python sr_device_worker.py OUT.json     # runs every check_* function, writes {name: "" | error text}
"""

import json
import os
import sys
import traceback

sys.path[:0] = [os.path.dirname(__file__), os.path.dirname(os.path.dirname(os.path.dirname(__file__)))]

import jax  # noqa: E402
import numpy as np  # noqa: E402

from cfir_jax.search.device_sr import DeviceCache  # noqa: E402

N, D = 1000, 16


def exact_scores_numpy(cache: np.ndarray, query: np.ndarray, ids: np.ndarray, k: int
                       ) -> tuple[np.ndarray, np.ndarray]:
    """Reference SR: float32 dot of rows ids [M] (unique) with query [D]; top-k best first, ties to the lower row."""
    ids = np.asarray(ids, np.int64)
    scores = np.asarray(cache[ids], np.float32) @ np.asarray(query, np.float32)
    order = np.lexsort((ids, -scores))[:k]
    return scores[order], ids[order].astype(np.int32)


def grid_cache(seed: int = 0, n: int = N) -> np.ndarray:
    """float16 rows of multiples of 1/4 in [-1, 1]: every dot with an integer query is exact in float32 whatever the
    summation order, so scores equal numpy's bit for bit and ties are common (they test the lower-row rule)."""
    rng = np.random.default_rng(seed)
    return (rng.integers(-4, 5, size=(n, D)) / 4).astype(np.float16)


def int_queries(q: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(-3, 4, size=(q, D)).astype(np.float32)


def _assert_equal_to_numpy(dc: DeviceCache, cache: np.ndarray, queries: np.ndarray, unions: list) -> None:
    got = dc.score_batch(queries, unions)
    for q, u, (s, r) in zip(queries, unions, got):
        want_s, want_r = exact_scores_numpy(cache, q, u, dc.k)
        assert len(r) == min(dc.k, len(u)), (len(r), len(u))
        np.testing.assert_array_equal(r, want_r)
        np.testing.assert_array_equal(s, want_s)


def unions_of_sizes(sizes, n: int = N, seed: int = 2) -> list:
    rng = np.random.default_rng(seed)
    return [np.sort(rng.choice(n, m, replace=False)).astype(np.int32) for m in sizes]


def check_cache_is_sharded_over_8_devices():
    assert len(jax.devices()) == 8
    dc = DeviceCache(grid_cache(), k=5, shard=True)
    assert dc.shards == 8
    assert len({s.device for s in dc.cache.addressable_shards}) == 8
    assert dc.cache.addressable_shards[0].data.shape[0] * 8 == dc.cache.shape[0]


def check_sharded_sr_equals_numpy_on_very_different_unions():
    cache = grid_cache()
    dc = DeviceCache(cache, k=20, shard=True, buckets=(8, 64, 256), query_batch=4)
    sizes = [1, 7, 8, 9, 63, 200, 256, 300, 999, 0, 3]  # across buckets, past the largest, empty
    _assert_equal_to_numpy(dc, cache, int_queries(len(sizes)), unions_of_sizes(sizes))


def check_k_larger_than_union_returns_the_whole_union():
    cache = grid_cache()
    dc = DeviceCache(cache, k=50, shard=True, buckets=(16, 128))
    unions = unions_of_sizes([5, 49, 50, 51])
    _assert_equal_to_numpy(dc, cache, int_queries(4), unions)
    assert [len(r) for _, r in dc.score_batch(int_queries(4), unions)] == [5, 49, 50, 50]


def check_empty_unions_give_empty_results():
    dc = DeviceCache(grid_cache(), k=5, shard=True)
    out = dc.score_batch(int_queries(2), [np.zeros(0, np.int32), np.zeros(0, np.int32)])
    assert all(len(s) == 0 and len(r) == 0 for s, r in out)
    assert dc.traces == 0  # nothing was sent to the devices


def check_ties_go_to_the_lower_row_across_shards():
    # Identical rows everywhere: every score ties; the top-k must be the k lowest rows of the union, in order.
    cache = np.ones((N, D), np.float16)
    dc = DeviceCache(cache, k=10, shard=True, buckets=(512,))
    union = unions_of_sizes([400])[0]
    (_, rows), = dc.score_batch(int_queries(1), [union])
    np.testing.assert_array_equal(rows, union[:10])


def check_one_compilation_per_bucket():
    cache = grid_cache()
    dc = DeviceCache(cache, k=10, shard=True, buckets=(64, 512), query_batch=2)
    for sizes in ([3, 60], [64, 2], [10, 20], [33, 1, 5, 40]):  # all in bucket 64, calls of 2 queries
        _assert_equal_to_numpy(dc, cache, int_queries(len(sizes)), unions_of_sizes(sizes))
    assert dc.traces == 1, dc.traces
    dc.score_batch(int_queries(2), unions_of_sizes([100, 500]))  # bucket 512
    assert dc.traces == 2, dc.traces
    dc.score_batch(int_queries(3), unions_of_sizes([100, 500, 7]))  # bucket 512 reused; bucket 64 with 1 query: new
    assert dc.traces == 3, dc.traces


def check_unsharded_and_bfloat16_equal_numpy():
    cache = grid_cache()  # multiples of 1/4 are exact in bfloat16 too
    for kwargs in (dict(shard=False), dict(shard=True, dtype="bfloat16")):
        dc = DeviceCache(cache, k=15, buckets=(128, 1024), **kwargs)
        assert dc.shards == (1 if kwargs["shard"] is False else 8)
        _assert_equal_to_numpy(dc, cache, int_queries(3), unions_of_sizes([100, 1000, 2]))


def check_auto_shards_a_cache_one_device_cannot_hold():
    """sr_device_shard='auto': a cache over half a device's memory (`_fits_one_device`, from the device's
    bytes_limit, which the CPU does not report: here a device says it holds less) is row-sharded over every device,
    and scores as numpy does; one that fits stays on one device."""
    from cfir_jax.search import device_sr

    cache = grid_cache()
    real = device_sr._fits_one_device
    try:
        device_sr._fits_one_device = lambda nbytes, device: False  # a device of too little memory
        sharded = DeviceCache(cache, k=12, shard=None, buckets=(64, 1024))
    finally:
        device_sr._fits_one_device = real
    alone = DeviceCache(cache, k=12, shard=None, buckets=(64, 1024))
    assert (sharded.shards, alone.shards) == (8, 1)
    for dc in (sharded, alone):
        _assert_equal_to_numpy(dc, cache, int_queries(3), unions_of_sizes([10, 64, 900]))


def check_full_topk_equals_numpy_over_shards():
    cache = grid_cache(n=997)  # not a multiple of 8: the last shard holds padding rows
    dc = DeviceCache(cache, k=10, shard=True)
    queries = int_queries(5)
    s, r = dc.full_topk(queries, 30)
    for q, si, ri in zip(queries, s, r):
        want_s, want_r = exact_scores_numpy(cache, q, np.arange(len(cache)), 30)
        np.testing.assert_array_equal(ri, want_r)
        np.testing.assert_array_equal(si, want_s)
    assert dc.full_topk(queries[:1], 5000)[1].shape == (1, 997)  # k clamped to N


def check_full_topk_with_a_partial_last_block():
    cache = grid_cache(n=997)
    dc = DeviceCache(cache, k=10, shard=False)
    dc.block = 300  # 997 rows = 3 blocks + a last one slid back over rows already scored
    s, r = dc.full_topk(int_queries(3), 50)
    for q, si, ri in zip(int_queries(3), s, r):
        want_s, want_r = exact_scores_numpy(cache, q, np.arange(len(cache)), 50)
        np.testing.assert_array_equal(ri, want_r)
        np.testing.assert_array_equal(si, want_s)


def check_subset_topk_equals_the_full_search_minus_the_other_rows_over_shards():
    """A filter's search over 8 shards (each with its own count of passing rows, one shard with none, blocks of
    100 rows so a shard's list spans several) equals the whole search minus the failing rows, scores bit-equal."""
    cache = grid_cache(n=997)
    dc = DeviceCache(cache, k=10, shard=True)
    dc.block = 100
    rng = np.random.default_rng(4)
    passing = rng.random(len(cache)) < 0.3
    passing[dc.rows_per_shard * 2 : dc.rows_per_shard * 3] = False  # shard 2 holds no passing row
    rows = np.flatnonzero(passing)
    queries = int_queries(5)
    s, r = dc.subset_topk(queries, rows, 40)
    all_s, all_r = dc.full_topk(queries, len(cache))
    for q in range(len(queries)):
        keep = passing[all_r[q]]
        np.testing.assert_array_equal(r[q], all_r[q][keep][:40])
        np.testing.assert_array_equal(s[q], all_s[q][keep][:40])
    assert dc.subset_topk(queries[:1], rows[:3], 40)[1].tolist() == [sorted(rows[:3], key=lambda x: (
        -float(np.asarray(cache[x], np.float32) @ queries[0]), x))]


def check_the_subset_program_compiles_from_shapes_alone_and_equals_the_cache():
    """The filtered search's program lowers from ShapeDtypeStructs (the sharded cache, each shard's rows [S, L]
    sharded over the mesh) and, compiled, answers as the resident cache's `subset_topk`."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from cfir_jax.search import device_sr

    cache = grid_cache()
    dc = DeviceCache(cache, k=20, shard=True)
    rows = np.flatnonzero(np.random.default_rng(5).random(N) < 0.2)
    ids = dc.shard_ids(rows)
    on_rows = NamedSharding(dc.mesh, P(device_sr.AXIS, None))
    program = device_sr.device_subset_topk.lower(
        device_sr.abstract_cache(N, D, "float16", dc.mesh), jax.ShapeDtypeStruct((4, D), np.float32),
        jax.ShapeDtypeStruct(ids.shape, np.int32, sharding=on_rows), k=9, block=dc.block, mesh=dc.mesh).compile()
    queries = int_queries(4)
    s, r = program(dc.cache, jax.numpy.asarray(queries), jax.device_put(ids, on_rows))
    want_s, want_r = dc.subset_topk(queries, rows, 9)
    np.testing.assert_array_equal(np.asarray(r), want_r)
    np.testing.assert_array_equal(np.asarray(s), want_s)


def check_programs_compile_from_shapes_alone_and_equal_the_cache():
    """The module-level SR and full search lower from ShapeDtypeStructs (the sharded cache as `abstract_cache`, no
    array on any device) and, compiled, give the resident cache's own answers."""
    from cfir_jax.search import device_sr

    cache = grid_cache()
    dc = DeviceCache(cache, k=20, shard=True, buckets=(256,), query_batch=4)
    sizes = dict(rows_per_shard=dc.rows_per_shard, mesh=dc.mesh)
    abstract = device_sr.abstract_cache(N, D, "float16", dc.mesh)
    assert abstract.shape == dc.cache.shape and abstract.sharding == dc.cache.sharding
    q_shape = jax.ShapeDtypeStruct((4, D), np.float32)
    sr = device_sr.device_sr.lower(abstract, q_shape, jax.ShapeDtypeStruct((4, 256), np.int32), k=20,
                                   **sizes).compile()
    full = device_sr.device_full_topk.lower(abstract, q_shape, k=7, n=N, block=dc.block, **sizes).compile()
    queries, unions = int_queries(4), unions_of_sizes([3, 50, 200, 256])
    ids = np.full((4, 256), -1, np.int32)
    for j, u in enumerate(unions):
        ids[j, : len(u)] = u
    s, rows = sr(dc.cache, jax.numpy.asarray(queries), jax.numpy.asarray(ids))
    for j, (want_s, want_r) in enumerate(dc.score_batch(queries, unions)):
        np.testing.assert_array_equal(np.asarray(rows)[j, : len(want_r)], want_r)
        np.testing.assert_array_equal(np.asarray(s)[j, : len(want_s)], want_s)
    s, rows = full(dc.cache, jax.numpy.asarray(queries))
    want_s, want_r = dc.full_topk(queries, 7)
    np.testing.assert_array_equal(np.asarray(rows), want_r)
    np.testing.assert_array_equal(np.asarray(s), want_s)


def main(out: str) -> None:
    results = {}
    for name, fn in sorted(globals().items()):
        if name.startswith("check_"):
            try:
                fn()
                results[name] = ""
            except Exception:  # noqa: BLE001 - every check's failure is reported to the test
                results[name] = traceback.format_exc()
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
