"""SR latency: the two-pass SRScorer vs naive gather+dot vs exact full-cache search, on a synthetic clustered cache.

    python benchmarks/sr_latency.py --cache-file /tmp/sr/cache.npy --compact-dir /tmp/sr/compact128
        # 4M x 768 float16 (6 GB): generated on the first run (~2-4 min) and saved, reused afterwards
    python benchmarks/sr_latency.py --n-images 500000    # scaled down, generated in memory each run

Each query is a document: 10 entities, each with its top-`--per-entity` images, ~45% overlap by construction, and a
summary embedding near the entities. The three methods run interleaved query by query in one process, so machine
load (other jobs on the same cores) hits them alike: compare the ratios. Prints ms/query p50/p95 (wall) and CPU ms
per query (all our threads; what a quiet machine would approach), where the scorer's time goes, and the top-k
agreement with exact scoring of the same candidates.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

from cfir_jax.knn import exact_topk, synthetic_embeddings
from cfir_jax.sr_scorer import CompactCache, SRScorer, StageTimes, build_compact, unique_sorted


def make_documents(n: int, n_docs: int, per_entity: int, entities: int, seed: int) -> list[np.ndarray]:
    """Candidate unions with ~45% overlap: entities share a pool of images, plus their own. [ids [M] int32]"""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n_docs):
        shared = rng.choice(n, int(per_entity * 0.9), replace=False)
        lists = [np.concatenate([rng.choice(shared, per_entity // 2, replace=False),
                                 rng.integers(0, n, per_entity - per_entity // 2)]) for _ in range(entities)]
        docs.append(np.concatenate(lists).astype(np.int32))
    return docs


def load_cache(args) -> np.ndarray:
    """The float16 cache [N, D]: from --cache-file (generated and saved there if missing), else generated."""
    if args.cache_file is None:
        return synthetic_embeddings(args.n_images, args.dim, dtype=np.float16)
    path = Path(args.cache_file)
    if not path.exists():
        t = time.perf_counter()
        cache = synthetic_embeddings(args.n_images, args.dim, dtype=np.float16)
        tmp = path.with_name(path.name + ".partial.npy")
        np.save(tmp, cache)
        os.replace(tmp, path)
        print(f"generated and saved {path} in {time.perf_counter() - t:.1f}s")
        return cache
    cache = np.load(path, mmap_mode="r")
    if cache.shape != (args.n_images, args.dim) or cache.dtype != np.float16:
        raise SystemExit(f"{path} holds {cache.dtype} {cache.shape}, not float16 ({args.n_images}, {args.dim}); "
                         "pass matching --n-images/--dim or another --cache-file")
    # In memory (numpy backs big arrays with huge pages): a memmap adds a page fault per first touch of a page.
    return cache if args.mmap else np.array(cache)


def load_compact(args, cache: np.ndarray) -> CompactCache:
    if args.compact_dir is None:
        from cfir_jax.sr_scorer import compact_in_memory

        return compact_in_memory(cache, dims=args.compact_dims)
    if not Path(args.compact_dir).exists():
        build_compact(cache, args.compact_dir, dims=args.compact_dims, progress=True)
    c = CompactCache.open(args.compact_dir, expect_n=cache.shape[0], expect_dim=cache.shape[1])
    if c.dims != args.compact_dims:
        raise SystemExit(f"{args.compact_dir} has {c.dims} dims, not --compact-dims {args.compact_dims}")
    return c if args.mmap else CompactCache(c.rotation, np.array(c.codes), np.array(c.scales))


def pct(ts) -> tuple[float, float]:
    return np.percentile(ts, 50) * 1e3, np.percentile(ts, 95) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-images", type=int, default=4_000_000)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--cache-file", help=".npy float16 cache to reuse (written on the first run)")
    p.add_argument("--compact-dir", help="build_compact directory to reuse (built on the first run)")
    p.add_argument("--mmap", action="store_true", help="score from memory maps instead of loading into memory")
    p.add_argument("--queries", type=int, default=40)
    p.add_argument("--per-entity", type=int, default=10_000)
    p.add_argument("--compact-dims", type=int, default=128)
    p.add_argument("--shortlist", type=int, default=2048)
    p.add_argument("--k", type=int, default=1000)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--naive-queries", type=int, default=10)
    p.add_argument("--exact-queries", type=int, default=3, help="full-cache exact searches (seconds each at 4M)")
    args = p.parse_args()
    print(f"cache {args.n_images:,} x {args.dim} float16; cpus={os.cpu_count()}; {platform.machine()} "
          f"{platform.processor() or platform.platform()}; jax {jax.__version__} on {jax.devices()[0].platform}; "
          f"load average at start {os.getloadavg()[0]:.1f}")
    t = time.perf_counter()
    cache = load_cache(args)
    compact = load_compact(args, cache)
    print(f"cache + compact copy ({compact.dims} int8 + scale per row, {compact.codes.nbytes / 2**20:.0f} MiB) "
          f"ready in {time.perf_counter() - t:.1f}s")
    docs = make_documents(args.n_images, args.queries, args.per_entity, 10, seed=1)
    rng = np.random.default_rng(2)
    queries = []
    for ids in docs:
        q = np.asarray(cache[rng.choice(ids, 10)], np.float32).mean(0)
        queries.append(q / np.linalg.norm(q))
    sizes = [len(unique_sorted(d)) for d in docs]
    print(f"candidates per query: {np.mean([len(d) for d in docs]):.0f} with duplicates, "
          f"{np.mean(sizes):.0f} unique ({1 - np.mean(sizes) / np.mean([len(d) for d in docs]):.1%} overlap)")

    scorer = SRScorer(cache, compact, shortlist=args.shortlist, k=args.k, threads=args.threads)
    naive_fn = jax.jit(lambda rows, q: jax.lax.top_k(jnp.dot(rows.astype(jnp.float32), q), args.k))

    def naive(q, ids):
        u = unique_sorted(ids)
        pad = np.zeros(1 << int(np.ceil(np.log2(u.size))), np.int32)
        pad[: u.size] = u
        return jax.block_until_ready(naive_fn(np.take(cache, pad, axis=0), q))

    for q, ids in list(zip(queries, docs))[:2]:  # warm-up: thread pools, BLAS, the naive jit
        scorer.score(q, ids)
        naive(q, ids)
    times = StageTimes()
    total, cpu, naive_t, exact_t, agree = [], [], [], [], []
    for i, (q, ids) in enumerate(zip(queries, docs)):
        c0, t0 = time.process_time(), time.perf_counter()
        _, top = scorer.score(q, ids, times)
        total.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        if i < args.naive_queries:
            t0 = time.perf_counter()
            naive(q, ids)
            naive_t.append(time.perf_counter() - t0)
        if i < args.exact_queries:
            t0 = time.perf_counter()
            exact_topk(q[None], cache, args.k)
            exact_t.append(time.perf_counter() - t0)
        u = unique_sorted(ids)
        ref = u[np.argsort(-(np.asarray(cache[u], np.float32) @ q))[: args.k]]
        agree.append(len(np.intersect1d(ref, top)) / args.k)

    p50, p95 = pct(total)
    print(f"load average at end {os.getloadavg()[0]:.1f} (1-minute; {os.cpu_count()} cpus)")
    print(f"SRScorer (compact {compact.dims}d int8, shortlist {args.shortlist}, {args.threads} threads): "
          f"p50 {p50:.2f} ms  p95 {p95:.2f} ms  min {np.min(total) * 1e3:.2f} ms; "
          f"CPU p50 {np.median(cpu) * 1e3:.2f} ms/query")
    for name, ms in times.p50_ms().items():
        print(f"  {name:12s} p50 {ms:.2f} ms")
    print(f"  top-{args.k} agreement with exact scoring of the same candidates: mean {np.mean(agree):.4f} "
          f"min {np.min(agree):.4f}")
    if naive_t:
        n50, n95 = pct(naive_t)
        print(f"naive gather f16 + f32 dot (jitted): p50 {n50:.2f} ms  p95 {n95:.2f} ms  -> SRScorer {n50 / p50:.1f}x "
              "faster")
    if exact_t:
        e50, e95 = pct(exact_t)
        print(f"exact full-cache search:            p50 {e50:.1f} ms  p95 {e95:.1f} ms  -> SRScorer {e50 / p50:.0f}x "
              "faster")


if __name__ == "__main__":
    main()
