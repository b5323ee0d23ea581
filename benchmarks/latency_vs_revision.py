"""Retrieval latency of this checkout against another git revision, in one process, interleaved query by query.

    python benchmarks/latency_vs_revision.py --base 75b20cb --n-images 1000000 \
        --cache-file /tmp/srbench1m/cache_1000000x768.npy --compact-dir /tmp/srbench1m/compact_128 \
        --workdir demo_work

The base revision's `cfir_jax` is extracted with `git archive` into a temporary folder and imported as
`cfir_jax_base` (its imports rewritten), so both versions run side by side on the very same arrays, and every query
is timed under both, in alternating order, so load from other jobs hits both alike. Stages (those of
benchmarks/retrieval_latency.py, on its synthetic cache and unions): the two-pass CPU SR (1 and 2 threads), the
paper's exact SR over a union, the device path (jitted exact SR, one query per call), and exact search of the whole
cache; with --workdir, the Retriever end to end on the split's documents (stored entities and summaries), one
document per call, per stage (`er`, `score`, `hits`) and in total. Prints p50 per version and the ratio new / base.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
from common import hardware_description  # also puts the repository root on sys.path
from retrieval_latency import load_averages, load_cache, load_compact, make_documents

from cfir_jax.core.cli import cli_main

ROOT = Path(__file__).resolve().parents[1]
# Where each concept lived: the first module path that exists in a version is used.
WHERE = {
    "SRScorer": ("search.cpu_sr", "retrieve.sr_scorer"),
    "CompactCache": ("search.compact", "retrieve.sr_scorer"),
    "exact_top_k": ("search.topk", "retrieve.sr_scorer"),
    "unique_sorted": ("search.topk", "retrieve.sr_scorer"),
    "DeviceCache": ("search.device_sr", "index.device_cache"),
    "exact_topk": ("search.topk", "index.knn"),
    "Retriever": ("retrieve.pipeline",),
    "workdir_config": ("cli",),
}


def base_package(revision: str, into: Path) -> str:
    """Extracts cfir_jax at `revision` into `into`/cfir_jax_base with its imports renamed; returns the name."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision, "cfir_jax"], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    (into / "cfir_jax").rename(into / "cfir_jax_base")
    for path in (into / "cfir_jax_base").rglob("*.py"):
        path.write_text(re.sub(r"\bcfir_jax\b", "cfir_jax_base", path.read_text()))
    sys.path.insert(0, str(into))
    return "cfir_jax_base"


def lookup(package: str, name: str):
    for module in WHERE[name]:
        try:
            return getattr(importlib.import_module(f"{package}.{module}"), name)
        except (ModuleNotFoundError, AttributeError):
            continue
    raise LookupError(f"{name} not found in {package}")


def interleaved(calls: dict, inputs: list) -> dict[str, list[float]]:
    """Seconds per input for each named call, the call order alternating per input."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for i, x in enumerate(inputs):
        for name in names if i % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            calls[name](x)
            times[name].append(time.perf_counter() - t0)
    return times


def line(stage: str, times: dict[str, list[float]]) -> str:
    base, new = (1e3 * np.median(times[k]) for k in ("base", "new"))
    n = len(times["new"])
    return f"{stage:58s} base p50 {base:9.2f} ms  new p50 {new:9.2f} ms  new/base {new / base:.3f}  ({n})"


def sr_stages(args, pkgs: dict[str, str]) -> None:
    cache = load_cache(args)
    compact = load_compact(args, cache)
    docs = make_documents(args.n_images, args.queries, args.per_entity, 10, seed=1)
    rng = np.random.default_rng(2)
    queries = []
    for ids in docs:
        q = np.asarray(cache[rng.choice(ids, 10)], np.float32).mean(0)
        queries.append(q / np.linalg.norm(q))
    pairs = list(zip(queries, docs))
    unions = [(q, lookup("cfir_jax", "unique_sorted")(ids)) for q, ids in pairs]
    for threads in (1, 2):
        scorers = {v: lookup(p, "SRScorer")(cache, lookup(p, "CompactCache")(compact.rotation, compact.codes,
                                                                              compact.scales),
                                            k=args.k, threads=threads) for v, p in pkgs.items()}
        interleaved({v: (lambda x, s=s: s.score(*x)) for v, s in scorers.items()}, pairs[:2])  # warm-up
        print(line(f"CPU SR, two-pass ({threads} thread(s))",
                   interleaved({v: (lambda x, s=s: s.score(*x)) for v, s in scorers.items()}, pairs)))
    exact = {v: lookup(p, "exact_top_k") for v, p in pkgs.items()}
    print(line("exact SR over the union (the paper's)",
               interleaved({v: (lambda x, f=f: f(cache, x[0], x[1], args.k)) for v, f in exact.items()},
                           unions[: args.naive_queries])))
    devices = {v: lookup(p, "DeviceCache")(cache, k=args.k) for v, p in pkgs.items()}
    interleaved({v: (lambda x, d=d: d.score(*x)) for v, d in devices.items()}, unions[:2])  # compile
    print(line("device path (jitted exact SR), one query per call",
               interleaved({v: (lambda x, d=d: d.score(*x)) for v, d in devices.items()},
                           unions[: args.naive_queries])))
    full = {v: lookup(p, "exact_topk") for v, p in pkgs.items()}
    interleaved({v: (lambda q, f=f: f(q[None], cache, args.k)) for v, f in full.items()}, queries[:1])  # compile
    print(line("exact search of the whole cache",
               interleaved({v: (lambda q, f=f: f(q[None], cache, args.k)) for v, f in full.items()},
                           queries[: args.exact_queries])))


def end_to_end(args, pkgs: dict[str, str]) -> None:
    retrievers = {v: lookup(p, "Retriever")(lookup(p, "workdir_config")(args.workdir), args.workdir, "cfir")
                  for v, p in pkgs.items()}
    docs = {v: r.corpus_documents(args.split)[: args.docs + 1] for v, r in retrievers.items()}  # each its own class
    results: dict[str, list] = {v: [] for v in pkgs}
    for v, r in retrievers.items():
        r.retrieve(docs[v][0])  # warm-up: models loaded, encoders compiled
    wall = interleaved({v: (lambda i, v=v, r=r: results[v].append(r.retrieve(docs[v][i]))) for v, r in
                        retrievers.items()}, list(range(1, len(docs["new"]))))
    for stage in results["new"][0].times_ms:
        print(line(f"Retriever, per document: {stage}",
                   {v: [x.times_ms[stage] / 1e3 for x in results[v]] for v in pkgs}))
    print(line("Retriever, per document: retrieve(doc) wall (encoding included)", wall))
    same = all([h.image_id for h in a.hits] == [h.image_id for h in b.hits] and
               [h.score for h in a.hits] == [h.score for h in b.hits] for a, b in zip(results["base"], results["new"]))
    print(f"hits of every document identical (ids and scores) between base and new: {same}")


@cli_main
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="git revision to compare with")
    p.add_argument("--n-images", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--cache-file", help=".npy float16 cache to reuse (written on the first run)")
    p.add_argument("--compact-dir", help="build_compact directory to reuse (built on the first run)")
    p.add_argument("--mmap", action="store_true")
    p.add_argument("--compact-dims", type=int, default=128)
    p.add_argument("--queries", type=int, default=40)
    p.add_argument("--per-entity", type=int, default=10_000)
    p.add_argument("--k", type=int, default=1000)
    p.add_argument("--naive-queries", type=int, default=10, help="queries of the exact SR and the device path")
    p.add_argument("--exact-queries", type=int, default=3, help="whole-cache searches (about a second each at 1M)")
    p.add_argument("--workdir", help="a built demo workdir: the Retriever end to end")
    p.add_argument("--part", choices=("sr", "e2e", "both"), default="both", help="e2e needs --workdir")
    p.add_argument("--split", default="test")
    p.add_argument("--docs", type=int, default=100)
    args = p.parse_args()
    print(hardware_description())
    print(f"load average (1/5/15 min) at the start: {load_averages()}")
    with tempfile.TemporaryDirectory() as tmp:
        pkgs = {"base": base_package(args.base, Path(tmp)), "new": "cfir_jax"}
        print(f"base: {args.base} (as cfir_jax_base), new: this checkout; {args.n_images:,} x {args.dim} float16, "
              f"top-{args.k}")
        if args.part in ("sr", "both"):
            sr_stages(args, pkgs)
        if args.workdir and args.part in ("e2e", "both"):
            end_to_end(args, pkgs)
    print(f"load average (1/5/15 min) at the end: {load_averages()}")


if __name__ == "__main__":
    main()
