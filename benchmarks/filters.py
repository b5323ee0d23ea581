"""What a filter on the images' own fields costs a query (docs/filters.md): p50 per document of the unfiltered
query and of the same query under a filter passing ~10% of the images, interleaved, in one run; and the size of
the candidate union under each (a filter must not grow it beyond what ER gives: `union_grew` counts the documents
whose filtered union is larger than their unfiltered one, and must be 0).

    flock /tmp/cfir-bench.lock python benchmarks/filters.py --demo demo_work
    flock /tmp/cfir-bench.lock python benchmarks/filters.py --demo demo_work --million /tmp/w1m --docs 100
    flock /tmp/cfir-bench.lock python benchmarks/filters.py --demo demo_work --million /tmp/w1m --docs 100 --facets

The demo world's images carry no fields, so the copy of W this runs on gets a column `n` = row mod 10 (written
with the builder's own `write_store`), and the filter is `n=0`. Methods: cfir (ER's union, then SR) and
dense_summary (a whole-cache search, which under a filter scores only the passing rows). With --million, the same
on the synthetic 1M-image index that `serve_load.make_million` makes from the demo (made or reused at that path,
then given the column). --sr-backend device runs SR and the whole-cache search on the JAX device (the CPU here).

With --facets, the cost of facets (issue 61 item 6: at most 1.1x): p50 per document through the library's `Index`
(`search_documents`, where facets are counted) of the same query without and with facets on three fields, a string
`source`, a list `tags` and a date `date` (by month), interleaved; the copy's columns: n, source, tags and date.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
from common import hardware_description
from serve_load import make_million

from cfir_jax.api.index import Index
from cfir_jax.builders.image_fields import columns_of, write_store
from cfir_jax.core.cli import workdir_config
from cfir_jax.core.query_rule import conditions
from cfir_jax.retrieve.pipeline import Retriever
from cfir_jax.stores.image_cache import ImageCache


def measure(w: Path, method: str, where: list[str], rounds: int, docs: int, backend: str) -> dict:
    config = workdir_config(w)
    if backend:
        config.retrieval.sr_backend = backend
    retriever = Retriever(config, w, method)
    chosen = retriever.corpus_documents("test")[:docs]
    filtered = [dataclasses.replace(d, where=conditions(where)) for d in chosen]  # each document carries its filter
    retriever.retrieve_many(chosen[:4])
    retriever.retrieve_many(filtered[:4])
    times = {"all": [], "filtered": []}
    unions = {"all": [], "filtered": []}
    for _ in range(rounds):
        for doc, under in zip(chosen, filtered):  # interleaved: a load spike hits both sides alike
            for side, d in (("all", doc), ("filtered", under)):
                t0 = time.perf_counter()
                r = retriever.retrieve_many([d])[0]
                times[side].append(1e3 * (time.perf_counter() - t0))
                unions[side].append(r.num_candidates)
    p50 = {s: statistics.median(t) for s, t in times.items()}
    grew = int((np.asarray(unions["filtered"]) > np.asarray(unions["all"])).sum())
    return {"method": method, "backend": retriever.sr.backend(), "docs": len(chosen),
            "p50_all_ms": round(p50["all"], 3), "p50_filtered_ms": round(p50["filtered"], 3),
            "ratio": round(p50["filtered"] / p50["all"], 3), "union_all": round(statistics.mean(unions["all"]), 1),
            "union_filtered": round(statistics.mean(unions["filtered"]), 1), "union_grew": grew}


FACETS = ("source", "tags", "date")


def measure_facets(w: Path, method: str, rounds: int, docs: int, backend: str) -> dict:
    """p50 per document of `Index.search_documents` without and with facets on FACETS, interleaved."""
    config = workdir_config(w)
    if backend:
        config.retrieval.sr_backend = backend
    index = Index(config, w, method)
    chosen = index.corpus_documents("test")[:docs]
    faceted = [dataclasses.replace(d, facets=FACETS) for d in chosen]
    index.search_documents(chosen[:4], 20)
    index.search_documents(faceted[:4], 20)
    times: dict[str, list[float]] = {"plain": [], "facets": []}
    ranked = []
    for _ in range(rounds):
        for doc, asked in zip(chosen, faceted):  # interleaved: a load spike hits both sides alike
            for side, d in (("plain", doc), ("facets", asked)):
                t0 = time.perf_counter()
                r = index.search_documents([d], 20)[0]
                times[side].append(1e3 * (time.perf_counter() - t0))
                ranked += [r.ranked] if r.ranked is not None else []
    p50 = {s: statistics.median(t) for s, t in times.items()}
    return {"method": method, "docs": len(chosen), "facets": ",".join(FACETS), "p50_plain_ms": round(p50["plain"], 3),
            "p50_facets_ms": round(p50["facets"], 3), "ratio": round(p50["facets"] / p50["plain"], 3),
            "ranked_mean": round(statistics.mean(ranked), 1) if ranked else 0}


def with_column(w: Path, facets: bool = False) -> int:
    """Writes W/image_fields with the column n = row mod 10 (the filter n=0 passes 10%), and with `facets` a source
    (10 values), tags (a list of two of 50) and a date (one of 24 months); returns the rows."""
    cache = ImageCache.open(w / "image_cache")
    n = cache.num_images
    rows = [{"n": r % 10, **({"source": f"s{r % 10}", "tags": [f"t{r % 50}", f"t{(r * 7) % 50}"],
                              "date": f"{2019 + r % 2}-{1 + r % 12:02d}-15"} if facets else {})} for r in range(n)]
    write_store(w / "image_fields", columns_of(rows, {}), cache, 0.0)
    return n


def run(w: Path, args, label: str) -> None:
    rows = with_column(w, args.facets)
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    what = f"facets on {', '.join(FACETS)}" if args.facets else "filter n=0 (10%)"
    print(f"== {label}: {rows:,} images, {what}; {load}", flush=True)
    for method in ("cfir", "dense_summary"):
        if args.facets:
            print(measure_facets(w, method, args.rounds, args.docs, args.sr_backend), flush=True)
        else:
            print(measure(w, method, ["n=0"], args.rounds, args.docs, args.sr_backend), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--demo", required=True, help="a built demo workdir (copied; left untouched)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--docs", type=int, default=10**9, help="test documents measured (all by default)")
    p.add_argument("--million", default="", help="where to make (or reuse) the synthetic 1M-image index")
    p.add_argument("--n-images", type=int, default=1_000_000)
    p.add_argument("--k", type=int, default=10_000, help="candidates per entity in the synthetic index")
    p.add_argument("--sr-backend", default="", choices=("", "cpu", "device"), help="retrieval.sr_backend")
    p.add_argument("--facets", action="store_true", help="measure facets on three fields instead of a filter")
    args = p.parse_args()
    print(hardware_description())
    with tempfile.TemporaryDirectory() as tmp:
        w = Path(tmp) / "W"
        shutil.copytree(args.demo, w)
        run(w, args, "the demo")
    if args.million:
        make_million(args.demo, args.million, args.n_images, args.k)
        run(Path(args.million), args, "the synthetic index")


if __name__ == "__main__":
    main()
