"""What an entity index update costs, and when the ScaNN tree should be rebuilt after images were appended.

    python benchmarks/entity_index_update.py                                   # 100,000 x 768, K=100
    python benchmarks/entity_index_update.py --n-images 20000 --dim 64 --tails 1000,5000

Part `tail`: an unseen entity is searched by the stored tree over the rows it was built on plus exact search over
the rows appended since (`search_with_tail`). For each tail size T of `--tails` it times one query and a batch of
256 through the tree alone and through the exact tail alone, so the tail's cost can be read against the tree's;
the tree should be rebuilt (a full `index.py` build or `--compact`) once the tail costs about as much as the tree.

Part `update`: `stage_images_added` of `--added` rows to an exact index of `--entities` entities, against a scratch
`build_entity_index` over the union (both on the host, exact backend).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
from common import hardware_description

from cfir_jax.builders.entity_index_build import EntityIndexSettings, build_entity_index
from cfir_jax.builders.entity_index_update import StageSettings, stage_images_added
from cfir_jax.search.knn import ScannSearcher, search_with_tail, synthetic_embeddings
from cfir_jax.search.topk import exact_topk
from cfir_jax.stores.entity_index import EntityIndex


def _best_of(fn, repeat: int = 3) -> float:
    fn()  # compiles
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def tail_part(args) -> None:
    tails = [int(t) for t in args.tails.split(",")]
    n = args.n_images
    images = synthetic_embeddings(n + max(tails), args.dim, seed=0, dtype=np.float16)
    queries = synthetic_embeddings(256, args.dim, seed=1)
    t = time.perf_counter()
    tree = ScannSearcher.build(images[:n], args.k)
    print(f"tree over {n:,} rows built in {time.perf_counter() - t:.1f} s")
    tree_1 = _best_of(lambda: tree.search(queries[:1], args.k))
    tree_256 = _best_of(lambda: tree.search(queries, args.k))
    print(f"{'tail rows':>10}  {'tree 1q ms':>10}  {'tail 1q ms':>10}  {'tree 256q ms':>12}  {'tail 256q ms':>12}  "
          f"{'tree+tail 1q ms':>15}")
    for tail in tails:
        rows = images[n : n + tail]
        tail_1 = _best_of(lambda rows=rows: exact_topk(queries[:1], rows, args.k))
        tail_256 = _best_of(lambda rows=rows: exact_topk(queries, rows, args.k))
        both_1 = _best_of(lambda t=tail: search_with_tail(tree, images[: n + t], queries[:1], args.k))
        print(f"{tail:>10,}  {tree_1 * 1e3:>10.2f}  {tail_1 * 1e3:>10.2f}  {tree_256 * 1e3:>12.1f}  "
              f"{tail_256 * 1e3:>12.1f}  {both_1 * 1e3:>15.2f}")


def update_part(args) -> None:
    n, added = args.n_images, args.added
    images = synthetic_embeddings(n + added, args.dim, seed=0, dtype=np.float16)
    ents = synthetic_embeddings(args.entities, args.dim, seed=2)
    texts = [f"e{i}" for i in range(args.entities)]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        build_entity_index(tmp / "old", texts, ents, images[:n], EntityIndexSettings(args.k, backend="exact"),
                           model_fingerprint="b")
        old = EntityIndex.open(tmp / "old")
        (tmp / "stage").mkdir()
        t = time.perf_counter()
        stage_images_added(old, tmp / "stage", images, n, settings=StageSettings(cache_fingerprint="b"))
        update = time.perf_counter() - t
        t = time.perf_counter()
        build_entity_index(tmp / "scratch", texts, ents, images, EntityIndexSettings(args.k, backend="exact"),
                           model_fingerprint="b")
        scratch = time.perf_counter() - t
    print(f"{added:,} rows added to {n:,} x {args.dim}, {args.entities:,} entities, K={args.k}: "
          f"update {update:.1f} s, scratch build {scratch:.1f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="tail,update")
    ap.add_argument("--n-images", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--k", type=int, default=100)
    ap.add_argument("--tails", default="1000,5000,20000,50000")
    ap.add_argument("--entities", type=int, default=2048)
    ap.add_argument("--added", type=int, default=5000)
    args = ap.parse_args()
    print(hardware_description())
    if "tail" in args.parts:
        tail_part(args)
    if "update" in args.parts:
        update_part(args)


if __name__ == "__main__":
    main()
