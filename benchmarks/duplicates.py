"""What grouping near-duplicates costs at index time (docs/duplicates.md), against the entity index's build over the
same image cache, in one run: the ratio, at the demo's size and at synthetic sizes up to 1M images.

    flock /tmp/cfir-bench.lock python benchmarks/duplicates.py --demo demo_work --sizes 100000,1000000

Demo size: the demo's own cache and its own entity index settings (its entities' embeddings as W/entity_index holds
them, its K and backend), timed as index.py builds them (`build_entity_index`, `build_duplicates`; the text encoder's
time to embed the entities is left out: the ratio is larger than index.py's). A synthetic size N: the demo's rows, then
clustered unit rows (`search.knn.synthetic_embeddings`, the demo's dim) of which 1% are planted copies of another row
with tiny noise (cosine ~0.999); entities: N x the demo's entities per image, clustered unit rows too, K = the
demo's K; each on its `auto` backend's CPU choice (the entity index: ScaNN; the grouping: 'partition'). Printed per
size: both times, the ratio (goal: at most 2), the groups found, the planted pairs grouped together and, up to
60,000 images, the share of all near pairs (exact search, untimed) that the grouping found.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
from common import hardware_description

from cfir_jax.builders.candidate_search import resolve_backend
from cfir_jax.builders.duplicates import backend_of, build_duplicates, near_pairs, searcher
from cfir_jax.builders.entity_index_build import EntityIndexSettings, build_entity_index
from cfir_jax.core.cli import workdir_config
from cfir_jax.search.knn import synthetic_embeddings
from cfir_jax.stores.image_cache import ImageCache

EXACT_UP_TO = 60_000  # sizes whose near pairs are also found exactly, for the neighbour search's recall


class Cache:
    """What the duplicates stage reads of an image cache, over an array."""

    def __init__(self, embeddings: np.ndarray):
        self.embeddings, self.num_images = embeddings, len(embeddings)
        self.ids = [f"r{i}" for i in range(self.num_images)]
        self.removed = np.zeros(self.num_images, bool)
        self.content_fingerprint, self.manifest = f"bench-{self.num_images}", {}


def synthetic(base: np.ndarray, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """[n, D] float16: `base`, then clustered unit rows; 1% of the rows are copies of another with tiny noise.
    Returns (rows, planted pairs [P, 2])."""
    rng = np.random.default_rng(seed)
    out = np.empty((n, base.shape[1]), np.float16)
    out[: len(base)] = base
    out[len(base) :] = synthetic_embeddings(n - len(base), base.shape[1], seed=seed)
    copies = rng.choice(np.arange(len(base), n), size=2 * (n // 100), replace=False).reshape(-1, 2)
    noisy = out[copies[:, 0]].astype(np.float32) + 0.004 * rng.standard_normal((len(copies), base.shape[1]))
    out[copies[:, 1]] = noisy / np.linalg.norm(noisy, axis=1, keepdims=True)
    return out, copies


def timed(what, *args, **kwargs) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = what(*args, **kwargs)
    return time.perf_counter() - t0, out


def one_size(images: np.ndarray, entities: np.ndarray, k: int, backend: str, settings: dict, tmp: Path,
             planted: np.ndarray | None) -> dict:
    texts = [f"entity {i}" for i in range(len(entities))]
    base_s, _ = timed(build_entity_index, tmp / "entity_index", texts, entities, images,
                      EntityIndexSettings(k, backend=backend, recall_sample=0), model_fingerprint="bench")
    group_s, store = timed(build_duplicates, tmp / "duplicates", Cache(images), settings, progress=True)
    found = float(np.mean(store.group[planted[:, 0]] == store.group[planted[:, 1]])) if planted is not None else None
    recall = None
    if len(images) <= EXACT_UP_TO:  # every near pair by exact search (untimed): what the neighbour search found
        n = len(images)
        truth = near_pairs(np.arange(n), n, searcher(images, "exact", settings["neighbours"]), settings["threshold"],
                           settings["neighbours"], settings["max_neighbours"])
        truth_set, got = {tuple(e) for e in truth.tolist()}, {tuple(e) for e in store.edges.tolist()}
        recall = len(truth_set & got) / len(truth_set) if truth_set else 1.0
    shutil.rmtree(tmp / "entity_index"), shutil.rmtree(tmp / "duplicates")
    return {"images": len(images), "dim": images.shape[1], "entities": len(entities), "k": k, "backend": backend,
            "entity_index_s": round(base_s, 2), "grouping_s": round(group_s, 2), "ratio": round(group_s / base_s, 3),
            "groups": store.manifest["num_groups"], "folded": store.manifest["num_folded"],
            "planted_pairs_grouped": found, "near_pairs_found": recall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--demo", required=True, help="a built demo workdir (read only)")
    p.add_argument("--sizes", default="100000,1000000", help="synthetic sizes, comma-separated ('' for none)")
    args = p.parse_args()
    w = Path(args.demo)
    config = workdir_config(w)
    cache = ImageCache.open(w / "image_cache")
    base = np.asarray(cache.embeddings)
    ei = json.loads((w / "entity_index" / "manifest.json").read_text())
    ents = np.load(w / "entity_index" / "entity_embeddings.npy")
    d = config.index.duplicates
    settings = {"threshold": float(d.threshold), "neighbours": int(d.neighbours),
                "max_neighbours": int(d.max_neighbours), "backend": backend_of(str(d.backend))}
    print(hardware_description())
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="cfir-dups-") as tmp:
        rows.append({"size": "demo", **one_size(base, np.asarray(ents, np.float32), int(ei["k"]), ei["backend"],
                                                 settings, Path(tmp), None)})
        print(json.dumps(rows[-1]), flush=True)
        per_image = int(ei["n_entities"]) / cache.num_images
        for n in [int(s) for s in args.sizes.split(",") if s]:
            images, planted = synthetic(base, n)
            entities = synthetic_embeddings(round(n * per_image), cache.dim, seed=2)
            backend = resolve_backend("auto")  # the CPU's choice for both: exact top-K of 1M is hours on 2 cores
            rows.append({"size": "synthetic", **one_size(images, entities, int(ei["k"]), backend, settings, Path(tmp),
                                                          planted)})
            print(json.dumps(rows[-1]), flush=True)
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    print(f"grouping backend: {settings['backend']}")
    print(f"{'images':>10} {'entities':>9} {'backend':>8} {'entity index s':>15} {'grouping s':>11} {'ratio':>6} "
          f"{'groups':>7} {'planted grouped':>16} {'near pairs found':>17}")
    for r in rows:
        planted = "-" if r["planted_pairs_grouped"] is None else f"{r['planted_pairs_grouped']:.4f}"
        found = "-" if r["near_pairs_found"] is None else f"{r['near_pairs_found']:.4f}"
        print(f"{r['images']:>10,} {r['entities']:>9,} {r['backend']:>8} {r['entity_index_s']:>15} "
              f"{r['grouping_s']:>11} {r['ratio']:>6} {r['groups']:>7,} {planted:>16} {found:>17}")


if __name__ == "__main__":
    main()
