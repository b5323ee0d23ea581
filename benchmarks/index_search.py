"""ScaNN vs exact top-K search over a synthetic clustered image cache: queries/s and recall@K.

    python benchmarks/index_search.py                       # 1,000,000 x 768 images (float32 for ScaNN: 3 GB)
    python benchmarks/index_search.py --n-images 100000 --k 1000
"""

from __future__ import annotations

import argparse
import os
import platform
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np

from cfir_jax.knn import ScannConfig, ScannSearcher, exact_topk, recall_at_k, synthetic_embeddings


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-images", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--queries", type=int, default=256)
    p.add_argument("--k", type=int, default=100)
    p.add_argument("--num-leaves-to-search", type=int, default=None)
    p.add_argument("--reorder", type=int, default=None)
    args = p.parse_args()
    print(f"images {args.n_images:,} x {args.dim}; queries {args.queries}; K={args.k}; cpus={os.cpu_count()}; "
          f"{platform.machine()} {platform.platform()}; jax {jax.__version__} on {jax.devices()[0].platform}")
    db = synthetic_embeddings(args.n_images, args.dim, seed=0)
    queries = synthetic_embeddings(args.queries, args.dim, seed=1)

    t = time.perf_counter()
    exact_s, exact_i = exact_topk(queries, db, args.k)
    exact_t = time.perf_counter() - t
    t = time.perf_counter()
    searcher = ScannSearcher.build(db, args.k, ScannConfig(num_leaves_to_search=args.num_leaves_to_search,
                                                           reorder=args.reorder))
    build_t = time.perf_counter() - t
    searcher.search(queries[:8], args.k)
    t = time.perf_counter()
    _, approx_i = searcher.search(queries, args.k)
    scann_t = time.perf_counter() - t
    print(f"ScaNN config: {searcher.config}")
    print(f"exact (blocked JAX matmul + top_k): {args.queries / exact_t:9.1f} queries/s")
    print(f"ScaNN (built in {build_t:.1f}s):       {args.queries / scann_t:9.1f} queries/s  "
          f"recall@{args.k} {recall_at_k(approx_i, exact_i):.4f}  -> {exact_t / scann_t:.1f}x faster than exact")


if __name__ == "__main__":
    main()
