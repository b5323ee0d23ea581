"""CPU locality experiment: does renumbering the cache rows by coarse cluster make SR's compact pass faster?

    python benchmarks/sr_locality.py --cache-file /tmp/srbench/cache_4000000x768.npy \
        --compact-dir /tmp/srbench/compact_128v2        # the files of retrieval_latency.py, shared
    python benchmarks/sr_locality.py --n-images 500000  # scaled down

The compact pass gathers one random 128-byte code row per unique candidate (~58k per query) and is bound by memory
latency. If rows near each other in embedding space were near each other in memory, a union (the top-K lists of a
document's related entities) would be a few long runs of nearby rows instead of scattered ones. This script:

1. ER as in CFIR: each query document has 10 related entities (noisy copies of one topic direction drawn from the
   cache); each entity's candidate list is its exact top-`--per-entity` by dot product over the full float16 cache,
   so candidates are spatially coherent, as real ones are (uniform random ids could not show locality).
2. renumbering: k-means (`--clusters` centres, Lloyd on a row sample) in the compact copy's 128-dim PCA space, every
   row assigned to its nearest centre, rows sorted by cluster id (stable); public ids would map through the
   permutation, so unions are renumbered with it and the results map back exactly.
3. the compact pass (`SRScorer.approximate_scores`, the exact same scores in either order) over every union in the
   original and in the clustered order, interleaved query by query; and the 4 KiB pages each union's gathers touch.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from common import hardware_description  # also puts the repository root on sys.path
from retrieval_latency import load_cache, load_compact, pct

from cfir_jax.core.cli import cli_main
from cfir_jax.core.errors import CfirError
from cfir_jax.search.compact import CompactCache
from cfir_jax.search.cpu_sr import SRScorer
from cfir_jax.search.topk import unique_sorted

_CHUNK = 65536


def load_averages() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def entity_queries(cache: np.ndarray, docs: int, entities: int, noise: float, seed: int) -> np.ndarray:
    """[docs, entities, D] float32 unit vectors: per document, noisy copies of one cache row (its topic)."""
    rng = np.random.default_rng(seed)
    topics = np.asarray(cache[np.sort(rng.choice(len(cache), docs, replace=False))], np.float32)
    e = topics[:, None, :] + noise * rng.standard_normal((docs, entities, cache.shape[1]), dtype=np.float32) \
        / np.sqrt(cache.shape[1])
    return e / np.linalg.norm(e, axis=-1, keepdims=True)


def exact_lists(cache: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    """Exact top-k rows by dot product for queries [Q, D] over cache [N, D], chunked: [Q, k] int32 (unordered)."""
    best_s = np.full((len(queries), k), -np.inf, np.float32)
    best_i = np.zeros((len(queries), k), np.int64)
    qt = np.ascontiguousarray(queries.T)
    for a in range(0, len(cache), _CHUNK):
        s = (np.asarray(cache[a : a + _CHUNK], np.float32) @ qt).T  # [Q, chunk]
        all_s = np.concatenate([best_s, s], axis=1)
        all_i = np.concatenate([best_i, np.broadcast_to(np.arange(a, a + s.shape[1]), s.shape)], axis=1)
        keep = np.argpartition(all_s, all_s.shape[1] - k, axis=1)[:, -k:]
        best_s, best_i = np.take_along_axis(all_s, keep, 1), np.take_along_axis(all_i, keep, 1)
    return best_i.astype(np.int32)


def kmeans_order(compact: CompactCache, clusters: int, sample: int, iters: int, seed: int) -> np.ndarray:
    """Permutation [N]: rows sorted by nearest k-means centre in the compact (PCA, int8) space, stable."""
    rng = np.random.default_rng(seed)
    n = compact.codes.shape[0]
    x = compact.codes[np.sort(rng.choice(n, min(sample, n), replace=False))].astype(np.float32) * compact.scales
    centres = x[rng.choice(len(x), clusters, replace=False)]
    for _ in range(iters):
        assign = np.argmax(x @ centres.T - 0.5 * (centres * centres).sum(1), axis=1)
        for c in range(clusters):
            members = x[assign == c]
            if len(members):
                centres[c] = members.mean(0)
    bias = 0.5 * (centres * centres).sum(1)
    assign = np.empty(n, np.int32)
    for a in range(0, n, _CHUNK):
        block = compact.codes[a : a + _CHUNK].astype(np.float32) * compact.scales
        assign[a : a + len(block)] = np.argmax(block @ centres.T - bias, axis=1)
    return np.argsort(assign, kind="stable")


def pages(ids: np.ndarray, row_bytes: int) -> int:
    """Distinct 4 KiB pages touched when gathering rows ids (sorted) of row_bytes each."""
    return len(np.unique((ids.astype(np.int64) * row_bytes) >> 12))


@cli_main
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-images", type=int, default=4_000_000)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--cache-file", help=".npy float16 cache to reuse (written on the first run)")
    p.add_argument("--compact-dir", help="build_compact directory to reuse (built on the first run)")
    p.add_argument("--compact-dims", type=int, default=128)
    p.add_argument("--queries", type=int, default=20)
    p.add_argument("--entities", type=int, default=10)
    p.add_argument("--per-entity", type=int, default=10_000)
    p.add_argument("--noise", type=float, default=1.0, help="entity spread around the document topic")
    p.add_argument("--clusters", type=int, default=1024)
    p.add_argument("--sample", type=int, default=100_000, help="rows k-means is fitted on")
    p.add_argument("--repeats", type=int, default=5, help="timed passes over every union, per order")
    args = p.parse_args()
    args.mmap = False
    if min(args.n_images, args.queries, args.entities, args.per_entity, args.clusters, args.repeats) < 1 or \
            args.per_entity > args.n_images or args.clusters > min(args.sample, args.n_images):
        raise CfirError("need positive sizes, --per-entity <= --n-images and --clusters <= --sample, --n-images")
    print(hardware_description())
    print(f"load average (1/5/15 min) at start {load_averages()}")
    t = time.perf_counter()
    cache = load_cache(args)
    compact = load_compact(args, cache)
    print(f"cache {cache.shape[0]:,} x {cache.shape[1]} float16 + compact {compact.dims} dims ready in "
          f"{time.perf_counter() - t:.1f}s")

    t = time.perf_counter()
    ents = entity_queries(cache, args.queries, args.entities, args.noise, seed=3)
    lists = exact_lists(cache, ents.reshape(-1, cache.shape[1]), args.per_entity)
    lists = lists.reshape(args.queries, args.entities, args.per_entity)
    unions = [unique_sorted(rows.ravel()) for rows in lists]
    summaries = ents.mean(1)
    summaries /= np.linalg.norm(summaries, axis=1, keepdims=True)
    sizes = [len(u) for u in unions]
    print(f"ER: {args.queries} documents x {args.entities} entities x top-{args.per_entity:,} exact, "
          f"{np.mean(sizes):,.0f} unique candidates per document ({min(sizes):,}-{max(sizes):,}) "
          f"in {time.perf_counter() - t:.1f}s")

    t = time.perf_counter()
    order = kmeans_order(compact, args.clusters, args.sample, iters=10, seed=0)
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    clustered = CompactCache(compact.rotation, np.ascontiguousarray(compact.codes[order]), compact.scales)
    renumbered = [np.sort(inverse[u]).astype(np.int32) for u in unions]
    print(f"renumbering: k-means {args.clusters} clusters on {args.sample:,} rows, all rows assigned and sorted in "
          f"{time.perf_counter() - t:.1f}s")

    # The compact pass reads only the codes; the float16 cache argument only fixes N and D.
    scorers = {"original order": (SRScorer(cache, compact), unions),
               "clustered order": (SRScorer(cache, clustered), renumbered)}
    for q, (u, v) in zip(summaries[:2], zip(unions, renumbered)):  # warm-up
        scorers["original order"][0].approximate_scores(q, u)
        scorers["clustered order"][0].approximate_scores(q, v)
    # Scores of the same rows agree up to BLAS summation order (a row's place in a chunk can change it).
    same = all(np.allclose(scorers["original order"][0].approximate_scores(q, u),
                           scorers["clustered order"][0].approximate_scores(q, v)[np.argsort(np.argsort(inverse[u]))],
                           rtol=1e-5, atol=1e-6)
               for q, u, v in zip(summaries[:3], unions, renumbered))
    load_before = load_averages()
    times = {name: [] for name in scorers}
    for _ in range(args.repeats):
        for i, q in enumerate(summaries):
            for name, (scorer, us) in scorers.items():  # interleaved: load from other jobs hits both alike
                t0 = time.perf_counter()
                scorer.approximate_scores(q, us[i])
                times[name].append(time.perf_counter() - t0)
    print(f"load average before the timed loop {load_before}, after it {load_averages()}")
    print(f"compact pass over each union ({args.repeats} passes x {args.queries} unions; same scores in both "
          f"orders: {same}):")
    base = np.median(times["original order"])
    for name, (_, us) in scorers.items():
        p50, p95, mn = pct(times[name])
        touched = np.mean([pages(u, compact.dims) for u in us])
        print(f"  {name:16s} p50 {p50:6.2f} ms  p95 {p95:6.2f} ms  min {mn:6.2f} ms  "
              f"({base / np.median(times[name]):.2f}x)  4 KiB pages touched per union {touched:,.0f}")


if __name__ == "__main__":
    main()
