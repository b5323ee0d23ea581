"""SR latency: the two-pass SRScorer vs naive gather+dot vs exact full-cache search, on a synthetic clustered cache.

    python benchmarks/sr_latency.py                      # 4M x 768 float16 (6 GB; ~1-2 min to generate)
    python benchmarks/sr_latency.py --n-images 500000    # scaled down; the gather cost depends on the union size

Each query is a document: 10 entities, each with its top-`--per-entity` images, ~45% overlap by construction, and a
summary embedding near the entities. Prints ms/query p50/p95, where the scorer's time goes, and top-1000 agreement.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np

from cfir_jax.knn import exact_topk, synthetic_embeddings
from cfir_jax.sr_scorer import SRScorer, compact_in_memory, unique_sorted


def make_documents(n: int, n_docs: int, per_entity: int, entities: int, seed: int):
    """Candidate unions with ~45% overlap: entities share a pool of images, plus their own. [(query [D], ids [M])]"""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n_docs):
        shared = rng.choice(n, int(per_entity * 0.9), replace=False)
        lists = [np.concatenate([rng.choice(shared, per_entity // 2, replace=False),
                                 rng.integers(0, n, per_entity - per_entity // 2)]) for _ in range(entities)]
        docs.append(np.concatenate(lists).astype(np.int32))
    return docs


def pct(ts):
    return np.percentile(ts, 50) * 1e3, np.percentile(ts, 95) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-images", type=int, default=4_000_000)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--queries", type=int, default=30)
    p.add_argument("--per-entity", type=int, default=10_000)
    p.add_argument("--compact-dims", type=int, default=128)
    p.add_argument("--shortlist", type=int, default=4096)
    p.add_argument("--k", type=int, default=1000)
    p.add_argument("--exact-queries", type=int, default=3, help="full-cache exact searches (slow at 4M)")
    args = p.parse_args()
    print(f"cache {args.n_images:,} x {args.dim} float16; cpus={os.cpu_count()}; {platform.machine()} "
          f"{platform.processor() or platform.platform()}; jax {jax.__version__} on {jax.devices()[0].platform}")
    t = time.perf_counter()
    cache = synthetic_embeddings(args.n_images, args.dim, dtype=np.float16)
    print(f"generated in {time.perf_counter() - t:.1f}s")
    t = time.perf_counter()
    compact = compact_in_memory(cache, dims=args.compact_dims)
    print(f"compact copy ({args.compact_dims} int8 + scale per row, {compact.codes.nbytes / 2**20:.0f} MiB) "
          f"built in {time.perf_counter() - t:.1f}s")
    docs = make_documents(args.n_images, args.queries, args.per_entity, 10, seed=1)
    rng = np.random.default_rng(2)
    queries = []
    for ids in docs:
        q = cache[rng.choice(ids, 10)].astype(np.float32).mean(0)
        queries.append(q / np.linalg.norm(q))
    sizes = [len(unique_sorted(d)) for d in docs]
    print(f"candidates per query: {np.mean([len(d) for d in docs]):.0f} with duplicates, "
          f"{np.mean(sizes):.0f} unique ({1 - np.mean(sizes) / np.mean([len(d) for d in docs]):.1%} overlap)")

    scorer = SRScorer(cache, compact, shortlist=args.shortlist, k=args.k)
    stages = {"dedup": [], "approx gather+score": [], "shortlist select": [], "exact re-rank+top-k": []}
    total, agree = [], []
    for q, ids in zip(queries, docs):
        scorer.score(q, ids)  # warm: the first call of each bucket compiles
    for q, ids in zip(queries, docs):
        t0 = time.perf_counter()
        s, top = scorer.score(q, ids)
        total.append(time.perf_counter() - t0)
        # Stage split, re-timed separately (same code path as score()).
        t0 = time.perf_counter(); u = unique_sorted(ids); t1 = time.perf_counter()
        a = scorer.approximate_scores(q, u); t2 = time.perf_counter()
        keep = u[np.sort(np.argpartition(a, u.size - args.shortlist)[u.size - args.shortlist:])]; t3 = time.perf_counter()
        pad = np.zeros(4096 if args.shortlist <= 4096 else args.shortlist, np.int32); pad[: keep.size] = keep
        jax.block_until_ready(scorer._rerank(np.take(cache, pad[: scorer.buckets[-1]], axis=0), q,
                                             pad[: scorer.buckets[-1]], np.int32(keep.size))); t4 = time.perf_counter()
        for name, dt in zip(stages, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            stages[name].append(dt)
        ref = u[np.argsort(-(np.asarray(cache[u], np.float32) @ q))[: args.k]]
        agree.append(len(np.intersect1d(ref, top)) / args.k)

    naive_fn = jax.jit(lambda rows, q: jax.lax.top_k(jnp.dot(rows.astype(jnp.float32), q), args.k))
    naive = []
    for q, ids in zip(queries[:10], docs[:10]):
        u = unique_sorted(ids)
        pad = np.zeros(1 << int(np.ceil(np.log2(u.size))), np.int32); pad[: u.size] = u
        t0 = time.perf_counter()
        jax.block_until_ready(naive_fn(np.take(cache, pad, axis=0), q))
        naive.append(time.perf_counter() - t0)
    naive = naive[1:]  # first call compiled
    exact = []
    for q in queries[: args.exact_queries]:
        t0 = time.perf_counter()
        exact_topk(q[None], cache, args.k)
        exact.append(time.perf_counter() - t0)

    p50, p95 = pct(total)
    print(f"SRScorer (compact {args.compact_dims}d int8, shortlist {args.shortlist}): p50 {p50:.2f} ms  p95 {p95:.2f} ms")
    for name, ts in stages.items():
        print(f"  {name:22s} p50 {pct(ts)[0]:.2f} ms")
    print(f"  top-{args.k} agreement with exact scoring of the same candidates: mean {np.mean(agree):.4f} "
          f"min {np.min(agree):.4f}")
    n50, n95 = pct(naive)
    e50, e95 = pct(exact)
    print(f"naive gather f16 + f32 dot (jitted): p50 {n50:.2f} ms  p95 {n95:.2f} ms  -> SRScorer {n50 / p50:.1f}x faster")
    print(f"exact full-cache search:            p50 {e50:.1f} ms  p95 {e95:.1f} ms  -> SRScorer {e50 / p50:.0f}x faster")


if __name__ == "__main__":
    main()
