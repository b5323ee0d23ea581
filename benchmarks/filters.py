"""What a filter on the pictures' own fields costs a query (docs/filters.md): p50 per document of the unfiltered
query and of the same query under a filter passing ~10% of the pictures, interleaved, in one run; and the size of
the candidate union under each (a filter must not grow it beyond what ER gives).

    flock /tmp/cfir-bench.lock python benchmarks/filters.py --demo demo_work

The demo world's pictures carry no fields, so the copy of W this runs on gets a column `n` = row mod 10 (written
with the builder's own `write_store`), and the filter is `n=0`. Methods: cfir (ER's union, then SR) and
dense_summary (a whole-cache search). The 1M synthetic index is not measured here.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from common import hardware_description

from cfir_jax.builders.image_fields import columns_of, write_store
from cfir_jax.core.cli import workdir_config
from cfir_jax.retrieve.pipeline import Retriever
from cfir_jax.stores.image_cache import ImageCache


def measure(w: Path, method: str, where: list[str], rounds: int) -> dict:
    retriever = Retriever(workdir_config(w), w, method)
    docs = retriever.corpus_documents("test")
    retriever.retrieve_many(docs[:4])
    retriever.retrieve_many(docs[:4], where=where)
    times = {"all": [], "filtered": []}
    unions = {"all": [], "filtered": []}
    for _ in range(rounds):
        for doc in docs:  # interleaved: a load spike hits both sides alike
            for side, wh in (("all", None), ("filtered", where)):
                t0 = time.perf_counter()
                r = retriever.retrieve_many([doc], where=wh)[0]
                times[side].append(1e3 * (time.perf_counter() - t0))
                unions[side].append(r.num_candidates)
    p50 = {s: statistics.median(t) for s, t in times.items()}
    return {"method": method, "docs": len(docs), "p50_all_ms": round(p50["all"], 3),
            "p50_filtered_ms": round(p50["filtered"], 3), "ratio": round(p50["filtered"] / p50["all"], 3),
            "union_all": round(statistics.mean(unions["all"]), 1),
            "union_filtered": round(statistics.mean(unions["filtered"]), 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--demo", required=True, help="a built demo workdir (copied; left untouched)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    print(hardware_description())
    with tempfile.TemporaryDirectory() as tmp:
        w = Path(tmp) / "W"
        shutil.copytree(args.demo, w)
        cache = ImageCache.open(w / "image_cache")
        write_store(w / "image_fields", columns_of([{"n": r % 10} for r in range(cache.num_images)], {}), cache, 0.0)
        for method in ("cfir", "dense_summary"):
            print(measure(w, method, ["n=0"], args.rounds))


if __name__ == "__main__":
    main()
