"""The duplicates stage's build: near-duplicate images grouped, for the store `cfir_jax.stores.duplicates` that a
search folds with (docs/duplicates.md).

A group is a connected component of the threshold graph: images are joined when the cosine of their (L2-normalised)
image cache rows is at least `index.duplicates.threshold`. The edges are never found by an [N, N] matmul:
- 'partition' (a CPU's default): rows put into sqrt(N) leaves by their 3 nearest k-means centres, each leaf's pairs
  scored exactly (`partition_pairs`);
- 'exact' (a GPU's or TPU's) and 'scann': every row searched for its `neighbours` nearest; a row whose last
  neighbour is still within the threshold is searched again with four times as many, up to `max_neighbours`, so
  every edge is found as long as no image has more near-duplicates than that (and the search finds them).
Union-find over the edges is scipy's connected components: O(N + E).

- build: every row searched against every row.
- after an add: the new rows searched against the whole cache (exactly), their edges added, groups made again.
- after a remove: the same edges, groups made again over the live rows (a removed image leaves its group, and a
  group it alone held together splits).
- after a compact: the edges of the kept rows re-numbered by the image cache's row map, groups made again.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

from cfir_jax.builders.candidate_search import resolve_backend
from cfir_jax.builders.descriptor import EXTEND, MASK, REMAP, Build, Changes, Stage, StageRun, Step, declare
from cfir_jax.builders.image_cache_update import row_map
from cfir_jax.builders.store_update import ChangeRun
from cfir_jax.core.progress import bar
from cfir_jax.search.knn import ScannConfig, ScannSearcher
from cfir_jax.search.topk import exact_topk
from cfir_jax.stores.contract import StoreError, atomic_dir, write_manifest
from cfir_jax.stores.duplicates import FORMAT_VERSION, KIND, Duplicates

# search(rows [Q] int, k) -> (scores [Q, k] float32, ids [Q, k] int32), best first, padded -inf / -1.
Search = Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]]
QUERY_CHUNK = 16384  # rows searched per call (bounds the [Q, k] answers and exact search's memory)
# backend 'partition': each row goes into the leaves of its 3 nearest centres (2 lost 0.5% of the near pairs on the
# benchmark's mix at 50,000 images, 3 none; benchmarks/duplicates.py)
SPILL = 3


def _ids_sha(ids: Sequence[str]) -> str:
    return hashlib.sha256("\n".join(ids).encode()).hexdigest()[:16]


def near_pairs(rows: np.ndarray, n: int, search: Search, threshold: float, neighbours: int, max_neighbours: int,
               progress: bool = False) -> np.ndarray:
    """int32 [E, 2] (i < j, unique): the pairs of `rows` [Q] with any of the n rows at cosine >= threshold, found by
    `search` for each row's nearest neighbours; a row whose last one is still within the threshold is searched
    again with 4x as many (up to max_neighbours + 1, itself included)."""
    found = [np.zeros((0, 2), np.int64)]
    cap = min(n, max(1, max_neighbours) + 1)
    k, todo = min(cap, max(1, neighbours) + 1), np.asarray(rows, np.int64)
    with bar(total=len(todo), unit="row", desc="duplicates", show=None if progress else False) as shown:
        while len(todo):
            again = []
            for start in range(0, len(todo), QUERY_CHUNK):
                q = todo[start : start + QUERY_CHUNK]
                scores, ids = search(q, k)
                near = (scores >= threshold) & (ids >= 0) & (ids != q[:, None])
                a, b = np.repeat(q, near.sum(axis=1)), ids[near].astype(np.int64)
                found.append(np.stack([np.minimum(a, b), np.maximum(a, b)], axis=1))
                if k < cap:  # saturated: its k-th neighbour is within the threshold, more may be
                    again.append(q[(scores[:, -1] >= threshold) & (ids[:, -1] >= 0)])
                shown.update(len(q)) if k == min(cap, max(1, neighbours) + 1) else None
            todo, k = (np.concatenate(again) if again else np.zeros(0, np.int64)), min(cap, 4 * k)
    pairs = np.concatenate(found)
    return np.unique(pairs, axis=0).astype(np.int32) if len(pairs) else np.zeros((0, 2), np.int32)


def groups(edges: np.ndarray, n: int, removed: np.ndarray | None = None) -> np.ndarray:
    """int32 [n]: each live row's group, the smallest live row of its connected component over the edges between
    live rows (a row alone: itself); -1 for a removed row."""
    removed = np.zeros(n, bool) if removed is None else np.asarray(removed, bool)
    edges = np.asarray(edges, np.int64).reshape(-1, 2)
    edges = edges[~removed[edges[:, 0]] & ~removed[edges[:, 1]]] if len(edges) else edges
    graph = coo_matrix((np.ones(len(edges), np.int8), (edges[:, 0], edges[:, 1])), shape=(n, n))
    _, label = connected_components(graph, directed=False)
    smallest = np.full(label.max(initial=-1) + 1, n, np.int64)
    np.minimum.at(smallest, label, np.arange(n))  # removed rows are components of their own: set to -1 below
    out = smallest[label].astype(np.int32)
    out[removed] = -1
    return out


def searcher(embeddings: np.ndarray, backend: str, neighbours: int) -> Search:
    """The neighbour search over every row of `embeddings` [N, D]: ScaNN (its tree and quantiser trained once, a
    short reorder) or exact blocked top-k."""
    if backend == "exact":
        return lambda q, k: exact_topk(np.asarray(embeddings[q], np.float32), embeddings, k)
    # The project's tree (sqrt(N) leaves, a fifth searched: fewer leaves lost a sixth of the near pairs on the
    # benchmark's mix, benchmarks/duplicates.py) and a short reorder: near-duplicates sit at the very top.
    config = ScannConfig(reorder=max(8 * (neighbours + 1), 64))
    scann = ScannSearcher.build(np.asarray(embeddings), neighbours + 1, config)
    return lambda q, k: scann.search(np.asarray(embeddings[q], np.float32), k)


def _leaves(x: np.ndarray, leaves: int, seed: int = 0, iters: int = 6) -> np.ndarray:
    """[leaves, D] unit centroids: spherical k-means on a sample of x's rows (64 per leaf, at most 200,000)."""
    rng = np.random.default_rng(seed)
    sample = np.asarray(x[np.sort(rng.choice(len(x), min(len(x), 64 * leaves, 200_000), replace=False))], np.float32)
    centres = sample[rng.choice(len(sample), leaves, replace=False)].copy()
    for _ in range(iters):
        sums = np.zeros_like(centres)
        np.add.at(sums, np.argmax(sample @ centres.T, axis=1), sample)
        norm = np.linalg.norm(sums, axis=1, keepdims=True)
        centres = np.where(norm > 0, sums / np.maximum(norm, 1e-12), centres)  # an empty leaf keeps its centre
    return centres


def partition_pairs(x: np.ndarray, threshold: float, max_neighbours: int, spill: int = SPILL,
                    progress: bool = False) -> np.ndarray:
    """int32 [E, 2] (i < j, unique): the near pairs of x [N, D] found leaf by leaf: sqrt(N) leaves (`_leaves`), each
    row put in the leaves of its `spill` nearest centres, every pair of a leaf scored exactly (one matmul per block
    of rows). Two near rows are found when their nearest centres share a leaf, which near rows' almost always do. A
    row with more than max_neighbours near rows in a leaf keeps its max_neighbours nearest (a burst of thousands of
    copies stays O(N) edges and one group)."""
    n = len(x)
    leaves = max(1, int(math.sqrt(n)))
    centres, spill = _leaves(x, leaves), min(spill, leaves)
    nearest = np.empty((n, spill), np.int32)
    for start in range(0, n, QUERY_CHUNK):
        scores = np.asarray(x[start : start + QUERY_CHUNK], np.float32) @ centres.T
        nearest[start : start + QUERY_CHUNK] = np.argpartition(-scores, spill - 1, axis=1)[:, :spill]
    order = np.argsort(nearest.ravel(), kind="stable")
    bounds = np.searchsorted(nearest.ravel()[order], np.arange(leaves + 1))
    found = [np.zeros((0, 2), np.int64)]
    with bar(total=leaves, unit="leaf", desc="duplicates", show=None if progress else False) as shown:
        for leaf in range(leaves):
            rows = np.sort(order[bounds[leaf] : bounds[leaf + 1]] // spill)
            block = np.asarray(x[rows], np.float32)
            for start in range(0, len(rows), 4096):
                sims = block[start : start + 4096] @ block.T
                sims[np.arange(len(sims)), start + np.arange(len(sims))] = -np.inf  # itself
                crowded = np.flatnonzero((sims >= threshold).sum(axis=1) > max_neighbours)
                for r in crowded:  # keep its max_neighbours nearest
                    sims[r, sims[r] < np.partition(sims[r], -max_neighbours)[-max_neighbours]] = -np.inf
                a, b = np.nonzero(sims >= threshold)
                a, b = rows[start + a], rows[b]
                found.append(np.stack([np.minimum(a, b), np.maximum(a, b)], axis=1))
            shown.update(1)
    pairs = np.concatenate(found)
    return np.unique(pairs, axis=0).astype(np.int32) if len(pairs) else np.zeros((0, 2), np.int32)


def write_store(out_dir: str | os.PathLike, edges: np.ndarray, cache, settings: dict, start: float) -> Duplicates:
    """Writes a complete store for the rows of `cache` from its edges (groups made over its live rows)."""
    n = cache.num_images
    label = groups(edges, n, cache.removed)
    live = label >= 0
    sizes = np.bincount(label[live], minlength=n) if n else np.zeros(0, np.int64)
    with atomic_dir(out_dir) as tmp:
        np.save(tmp / "edges.npy", np.asarray(edges, np.int32).reshape(-1, 2))
        np.save(tmp / "group.npy", label)
        write_manifest(tmp, KIND, FORMAT_VERSION, **settings, num_rows=n, num_edges=len(edges),
                       num_groups=int((sizes >= 2).sum()), num_folded=int(live.sum() - (sizes > 0).sum()),
                       cache_fingerprint=cache.content_fingerprint, ids_sha=_ids_sha(cache.ids),
                       removed_sha=cache.manifest.get("removed_sha"), build_seconds=round(time.time() - start, 3))
    return Duplicates.open(out_dir)


def _settings(config) -> dict:
    d = config.index.duplicates
    return {"threshold": float(d.threshold), "neighbours": int(d.neighbours), "max_neighbours": int(d.max_neighbours),
            "backend": backend_of(str(d.backend))}


def backend_of(setting: str) -> str:
    """index.duplicates.backend: 'auto' is exact top-k where a GPU or TPU is present, else 'partition' (a leaf
    self-join: faster and finding more near pairs than ScaNN on a CPU, benchmarks/duplicates.py); 'exact',
    'scann' and 'partition' are themselves."""
    if setting == "partition":
        return setting
    return "partition" if setting == "auto" and resolve_backend("auto") == "scann" else resolve_backend(setting)


def build_duplicates(out_dir: str | os.PathLike, cache, settings: dict, progress: bool = False) -> Duplicates:
    """The store for every row of `cache`; a current one (same cache build, same settings) is reused."""
    try:
        return Duplicates.open(out_dir, cache_fingerprint=cache.content_fingerprint, num_rows=cache.num_images,
                               threshold=settings["threshold"], neighbours=settings["neighbours"])
    except StoreError:
        pass
    start, n = time.time(), cache.num_images
    edges = np.zeros((0, 2), np.int32)
    if n > 1 and settings["backend"] == "partition":
        edges = partition_pairs(cache.embeddings, settings["threshold"], settings["max_neighbours"], progress=progress)
    elif n > 1:
        search = searcher(cache.embeddings, settings["backend"], settings["neighbours"])
        edges = near_pairs(np.arange(n), n, search, settings["threshold"], settings["neighbours"],
                           settings["max_neighbours"], progress)
    return write_store(out_dir, edges, cache, settings, start)


def duplicates_after_add(change: ChangeRun, out: Path) -> dict:
    """W/duplicates with the new rows searched against the whole cache (exactly) and grouped."""
    old, cache = change.old("duplicates"), change.new("image_cache")
    if cache.num_images < old.num_rows or _ids_sha(cache.ids[: old.num_rows]) != old.manifest["ids_sha"]:
        raise StoreError(f"{old.path}: the image cache does not extend the rows this store was built for; rebuild "
                         "it with index.py --stages duplicates")
    m, start = old.manifest, time.time()
    new = np.arange(old.num_rows, cache.num_images)
    edges = near_pairs(new, cache.num_images, searcher(cache.embeddings, "exact", int(m["neighbours"])),
                       float(m["threshold"]), int(m["neighbours"]), int(m["max_neighbours"]))
    edges = np.unique(np.concatenate([old.edges, edges]), axis=0) if len(edges) else old.edges
    settings = {k: m[k] for k in ("threshold", "neighbours", "max_neighbours", "backend")}
    store = write_store(out, edges, cache, settings, start)
    return {"rows": store.num_rows, "groups": int(store.manifest["num_groups"])}


def duplicates_after_removal(change: ChangeRun, out: Path) -> dict:
    """W/duplicates regrouped over the live rows: a removed image leaves its group."""
    old, cache = change.old("duplicates"), change.new("image_cache")
    settings = {k: old.manifest[k] for k in ("threshold", "neighbours", "max_neighbours", "backend")}
    store = write_store(out, old.edges, cache, settings, time.time())
    return {"groups": int(store.manifest["num_groups"])}


def duplicates_after_compaction(change: ChangeRun, out: Path) -> dict:
    """W/duplicates without the rows the compaction dropped (the image cache's row map), regrouped."""
    old, moved = change.old("duplicates"), row_map(change)
    edges = moved[old.edges.astype(np.int64)] if len(old.edges) else np.zeros((0, 2), np.int64)
    edges = edges[(edges >= 0).all(axis=1)]
    settings = {k: old.manifest[k] for k in ("threshold", "neighbours", "max_neighbours", "backend")}
    store = write_store(out, edges, change.new("image_cache"), settings, time.time())
    return {"rows": store.num_rows, "groups": int(store.manifest["num_groups"])}


def build_stage(run: StageRun) -> Duplicates:
    """Stage duplicates, on process 0 alone (the others wait, then open it)."""
    return build_duplicates(run.layout.duplicates, run.opened["image_cache"], _settings(run.config), progress=True)


def open_stage(run: StageRun) -> Duplicates:
    return Duplicates.open(run.layout.duplicates, cache_fingerprint=run.opened["image_cache"].content_fingerprint)


def stage_summary(store: Duplicates) -> str:
    """The stage's line of index.py's closing table."""
    m = store.manifest
    return (f"{m['num_groups']:,} groups of near-duplicates (cosine >= {m['threshold']:g}), {m['num_folded']:,} of "
            f"{m['num_rows']:,} images folded under another")


declare(Stage("duplicates", reader=Duplicates.open,
              build=Build(build_stage, stage_summary, every_host=False, open=open_stage),
              changes=Changes(add=Step(EXTEND, duplicates_after_add), remove=Step(MASK, duplicates_after_removal),
                              compact=Step(REMAP, duplicates_after_compaction))))
