"""What the stores' integrity checks cost at AToMiC-base scale (4M x 768 float16), each against the path without it.

    python benchmarks/integrity_cost.py --dir /tmp/integrity_bench      # cache generated there once, reused
    python benchmarks/integrity_cost.py --dir /tmp/integrity_bench --n-images 1000000   # scaled down

Build time: `integrity.write_checksums` over a store holding the cache's embeddings.npy (every byte read once and
hashed, sha256 per 64 MiB block), and `verify_store` (`index.py --verify`: the same reading, compared).
Open time: the entity index's new open-time check (`check_csr`): offsets monotone for E entities, and the range scan
of the candidate ids when there are few enough (`OPEN_SCAN_LIMIT`). Per query: SR on the fast path (the two-pass
scorer over a memory-mapped cache, as the Retriever holds it) of 10 entities x 10,000 candidates per query, with and
without the serving checks (`check_rows` on the sorted union, `check_scores` on the top-k), interleaved query by
query so load from other jobs hits both alike; prints p50 ms and the ratio new / old.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from pathlib import Path

import numpy as np
from common import hardware_description  # also puts the repository root on sys.path

from cfir_jax.core.cli import cli_main
from cfir_jax.core.errors import CfirError
from cfir_jax.stores import atomic_write, contract, integrity


def load_averages() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def cache_on_disk(path: Path, n: int, dim: int, chunk: int = 65536) -> np.ndarray:
    """A float16 [n, dim] cache of unit rows written block by block (never whole in memory), reused when there."""
    if not path.exists():
        t = time.perf_counter()
        rng = np.random.default_rng(0)
        tmp = atomic_write.temp_name(path, hidden=True)
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16, shape=(n, dim))
        for a in range(0, n, chunk):
            x = rng.standard_normal((min(chunk, n - a), dim), dtype=np.float32)
            out[a : a + len(x)] = x / np.linalg.norm(x, axis=1, keepdims=True)
        out.flush()
        del out
        os.replace(tmp, path)
        print(f"generated {path} in {time.perf_counter() - t:.1f} s")
    cache = np.load(path, mmap_mode="r")
    if cache.shape != (n, dim) or cache.dtype != np.float16:
        raise CfirError(f"{path} holds {cache.dtype} {cache.shape}, not float16 ({n}, {dim}); pass another --dir")
    return cache


def checksum_costs(cache_path: Path, work: Path) -> None:
    """write_checksums (build) and verify_store (--verify) over a store holding the cache file (a hard link)."""
    directory = work / "store_for_checksums"
    if directory.exists():
        atomic_write.remove_path(directory)
    directory.mkdir(parents=True)
    os.link(cache_path, directory / "embeddings.npy")
    contract.write_manifest(directory, "image_cache", 1)
    size = cache_path.stat().st_size
    t = time.perf_counter()
    integrity.write_checksums(directory)
    build = time.perf_counter() - t
    t = time.perf_counter()
    problems = integrity.verify_store(directory)
    verify = time.perf_counter() - t
    print(f"checksums of {size / 2**30:.2f} GB: recorded at build in {build:.1f} s ({size / build / 2**30:.2f} GB/s), "
          f"verified in {verify:.1f} s ({size / verify / 2**30:.2f} GB/s); problems: {len(problems)}")
    atomic_write.remove_path(directory)


def open_costs(n: int) -> None:
    """check_csr on an entity index's arrays: offsets only (large index), and with the full id scan (at the limit)."""
    rng = np.random.default_rng(1)
    for entities in (100_000, 1_000_000):
        lengths = rng.integers(1, 10_001, entities)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        values = np.lib.stride_tricks.as_strided(np.zeros(1, np.int32), (int(offsets[-1]),), (0,))  # no memory
        t = time.perf_counter()
        integrity.check_csr(offsets, values, n, "bench")
        print(f"open, entity index of {entities:,} entities ({offsets[-1]:,} candidates, above the scan limit): "
              f"offsets check {1e3 * (time.perf_counter() - t):.2f} ms")
    values = rng.integers(0, n, integrity.OPEN_SCAN_LIMIT, dtype=np.int32)
    offsets = np.linspace(0, len(values), 1_601, dtype=np.int64)
    best = min(_timed(lambda: integrity.check_csr(offsets, values, n, "bench")) for _ in range(3))
    print(f"open, entity index at the scan limit ({len(values):,} candidates): offsets + id range {1e3 * best:.1f} ms")


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def per_query(cache: np.ndarray, work: Path, queries: int, rounds: int) -> None:
    """SR per query, fast path, with and without the serving checks, interleaved."""
    from retrieval_latency import make_documents

    from cfir_jax.search.compact import build_compact
    from cfir_jax.search.cpu_sr import SRScorer
    from cfir_jax.search.topk import unique_sorted

    compact_dir = work / f"compact_{cache.shape[0]}"
    if not compact_dir.exists():
        t = time.perf_counter()
        build_compact(cache, compact_dir, progress=True)
        print(f"built the compact copy in {time.perf_counter() - t:.1f} s")
    scorer = SRScorer(cache, compact_dir)
    n = cache.shape[0]
    docs = make_documents(n, queries, 10_000, 10, seed=0)
    rng = np.random.default_rng(2)
    q = rng.standard_normal((queries, cache.shape[1]), dtype=np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)

    def old(i):
        union = unique_sorted(docs[i])
        return scorer.score(q[i], union)

    def new(i):
        union = unique_sorted(docs[i])
        integrity.check_rows(union, n, "bench")
        scores, rows = scorer.score(q[i], union)
        integrity.check_scores(scores, 1.0, "bench")
        return scores, rows

    for i in range(queries):  # warm-up: page cache, buffers
        old(i), new(i)
    # Two arms without the checks ("old", "old again") measure the noise floor of this machine: their ratio is what
    # "new / old" must be read against. Each query runs in every arm back to back, in rotating order.
    arms = {"old": old, "new": new, "old again": old}
    times: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(rounds):
        for i in range(queries):
            names = list(arms)
            shift = (i + r) % len(names)
            for name in names[shift:] + names[:shift]:
                times[name].append(_timed(functools.partial(arms[name], i)))
    p50 = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    total = {k: sum(v) for k, v in times.items()}
    paired = {k: statistics.median(a / b for a, b in zip(times[k], times["old"])) for k in ("new", "old again")}
    union = unique_sorted(docs[0])
    scores, _ = scorer.score(q[0], union)
    check = min(_timed(lambda: (integrity.check_rows(union, n, "b"), integrity.check_scores(scores, 1.0, "b")))
                for _ in range(200))
    unique = np.mean([len(unique_sorted(d)) for d in docs])
    print(f"per query, SR fast path ({queries} queries x {rounds} rounds, {unique:,.0f} unique candidates, "
          f"top-{scorer.k}): p50 without checks {p50['old']:.2f} ms (again: {p50['old again']:.2f}), with "
          f"{p50['new']:.2f} ms")
    for name in ("new", "old again"):
        print(f"  {name} / old: {p50[name] / p50['old']:.4f} (p50), {total[name] / total['old']:.4f} (total), "
              f"{paired[name]:.4f} (median of per-query ratios)")
    print(f"  the checks alone: {1e6 * check:.1f} us per query ({100 * check / (p50['old'] / 1e3):.4f}% of the p50)")


@cli_main
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="where the cache (and the compact copy) are generated once, reused")
    p.add_argument("--n-images", type=int, default=4_000_000)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--queries", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--skip-checksums", action="store_true")
    args = p.parse_args()
    work = Path(args.dir)
    work.mkdir(parents=True, exist_ok=True)
    print(hardware_description())
    print(f"load average (1/5/15 min) at start {load_averages()}")
    cache_path = work / f"cache_{args.n_images}x{args.dim}.npy"
    cache = cache_on_disk(cache_path, args.n_images, args.dim)
    if not args.skip_checksums:
        checksum_costs(cache_path, work)
    open_costs(args.n_images)
    per_query(cache, work, args.queries, args.rounds)
    print(f"load average at the end {load_averages()}")


if __name__ == "__main__":
    main()
