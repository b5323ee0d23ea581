"""Fused SR (image + image text) on the CPU: the fast path (compact copy of the [N, 2D] rows, exact re-rank of a
shortlist) against exact fused scoring of the whole union, and the paper's image-only fast SR, on the same queries.

    python benchmarks/fused_sr.py                       # 1M images x 768, two float16 caches (3 GB), ~5 min
    python benchmarks/fused_sr.py --n-images 200000 --queries 20

Each query is a union of `--union` candidates (the paper's ~55k at K=10,000 and 10 entities) and a unit summary
embedding; image text rows are correlated with their image rows (as the frozen text tower's are) and one in four
images has none (a zero row). The three scorers run interleaved, query by query, so load from other jobs hits each
alike. Prints ms/query p50 and min, the speed ratio of fast to exact fused SR, and the fast path's top-k agreement
with exact fused scoring of the same union.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
from common import hardware_description

from cfir_jax.search.compact import build_compact
from cfir_jax.search.cpu_sr import SRScorer
from cfir_jax.search.fused import FusedRows, fused_queries
from cfir_jax.search.knn import synthetic_embeddings
from cfir_jax.search.topk import exact_top_k


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-images", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--union", type=int, default=55_000)
    p.add_argument("--queries", type=int, default=30)
    p.add_argument("--k", type=int, default=1000)
    p.add_argument("--shortlist", type=int, default=2560)
    p.add_argument("--compact-dims", type=int, default=128)
    p.add_argument("--w-txt", type=float, default=0.5)
    args = p.parse_args()
    print(f"hardware: {hardware_description()}")
    n, d = args.n_images, args.dim
    t = time.perf_counter()
    images = synthetic_embeddings(n, d, seed=0).astype(np.float16)
    noise = synthetic_embeddings(n, d, seed=1)
    texts = images.astype(np.float32) + noise
    texts /= np.linalg.norm(texts, axis=1, keepdims=True)
    texts[::4] = 0  # images without text
    texts = texts.astype(np.float16)
    del noise
    rows = FusedRows(images, texts)
    print(f"caches: {n:,} x {d} float16, image and image text ({2 * images.nbytes / 2**30:.1f} GiB, made in "
          f"{time.perf_counter() - t:.0f} s); unions of {args.union:,}, k {args.k}, shortlist {args.shortlist}, "
          f"compact {args.compact_dims} dims, w_txt {args.w_txt}")
    rng = np.random.default_rng(2)
    unions = [np.unique(rng.integers(0, n, args.union)).astype(np.int32) for _ in range(args.queries)]
    queries = synthetic_embeddings(args.queries, d, seed=3)
    fq = fused_queries(queries, 1.0, args.w_txt)
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        fused = SRScorer(rows, build_compact(rows, f"{tmp}/fused", dims=args.compact_dims), args.shortlist, args.k)
        plain = SRScorer(images, build_compact(images, f"{tmp}/plain", dims=args.compact_dims), args.shortlist,
                         args.k)
        print(f"compact copies built in {time.perf_counter() - t:.0f} s (once per index, not per query)")
        ms = {"fused exact": [], "fused fast": [], "image-only fast (the paper's SR, fast)": []}
        agreement = []
        fused.score(fq[0], unions[0])
        plain.score(queries[0], unions[0])
        for q, f, u in zip(queries, fq, unions):
            t = time.perf_counter()
            _, exact_rows = exact_top_k(rows, f, u, args.k)
            ms["fused exact"].append(time.perf_counter() - t)
            t = time.perf_counter()
            _, fast_rows = fused.score(f, u)
            ms["fused fast"].append(time.perf_counter() - t)
            t = time.perf_counter()
            plain.score(q, u)
            ms["image-only fast (the paper's SR, fast)"].append(time.perf_counter() - t)
            agreement.append(len(np.intersect1d(exact_rows, fast_rows)) / len(exact_rows))
    for name, times in ms.items():
        print(f"  {name:40s} p50 {1e3 * np.median(times):7.2f} ms  min {1e3 * np.min(times):7.2f} ms")
    ratio = np.median(ms["fused exact"]) / np.median(ms["fused fast"])
    print(f"fused fast is {ratio:.1f}x faster than fused exact (p50); top-{args.k} agreement with exact: mean "
          f"{np.mean(agreement):.4f}, worst {np.min(agreement):.4f}")


if __name__ == "__main__":
    main()
