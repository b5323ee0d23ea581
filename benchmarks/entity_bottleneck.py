"""The single-process service against its bottleneck, spaCy, on the same distinct documents and cores, in one run.

    python benchmarks/entity_bottleneck.py --workdir demo_work [--docs 400] [--concurrency 16]

Prints, with `uptime`:
- the service (`retrieve.py --serve`, one process, its entity_workers.serve spaCy workers) answering every document
  once, `--concurrency` requests at a time: documents/s;
- spaCy's own `nlp.pipe` over the same documents (the index's pipeline and labels, the same `EntityExtractor`'s
  entities), in one process and in as many as the machine has usable cores (spaCy's own `n_process`), its workers
  started by fork after the model loaded and parsed a few documents here: warm, as the service's are: documents/s;
- the service's rate over spaCy's faster one (issue 60's goal: at least 0.8).
The documents are the corpus's, each made distinct (a number appended) so that no cache of the service answers one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
from pathlib import Path

from common import spacy_pipe_rate
from serve_load import Server, load  # also puts the repository root on sys.path

from cfir_jax.core.cli import workdir_config
from cfir_jax.data.corpus import Corpus


def documents(workdir: str, n: int) -> list[str]:
    corpus = Corpus.open(Path(workdir) / "corpus")
    return [f"{corpus.document(i % corpus.num_documents).text} ({i})" for i in range(n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True)
    p.add_argument("--docs", type=int, default=400)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("overrides", nargs="*", help="--config.* overrides for the server")
    args = p.parse_args()
    texts = documents(args.workdir, args.docs)
    workers = int(workdir_config(args.workdir).entity_workers.serve)
    for o in args.overrides:
        if o.startswith("--config.entity_workers.serve="):
            workers = int(o.split("=", 1)[1])
    server = Server(args.workdir, "--config.serve.verify_mb_per_s=0", *args.overrides)
    try:
        warm = [json.dumps({"text": t + " warm", "id": f"w{i}"}).encode() for i, t in enumerate(texts[:16])]
        asyncio.run(load(server.url, warm, args.concurrency))
        bodies = [json.dumps({"text": t, "id": f"d{i}"}).encode() for i, t in enumerate(texts)]
        served = asyncio.run(load(server.url, bodies, args.concurrency))
    finally:
        server.stop()
    found_in = workdir_config(args.workdir).index.entities
    cores = len(os.sched_getaffinity(0))
    rates = {n: spacy_pipe_rate(found_in, texts, n, "fork")[0] for n in sorted({1, cores})}
    pipe = max(rates.values())
    print(f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    print(f"usable cores: {cores}, service spaCy workers: {workers}, documents: {len(texts)}")
    print(f"service, concurrency {args.concurrency}: {served['rate']:.1f} documents/s "
          f"({served['ok']}/{served['n']} ok, p50 {served['p50']:.0f} ms)")
    for n, rate in rates.items():
        started = ", its workers forked after the model loaded and warmed" if n > 1 else ""
        print(f"spaCy nlp.pipe, n_process={n}{started}: {rate:.1f} documents/s")
    print(f"ratio service/spaCy (its faster): {served['rate'] / pipe:.2f} (goal >= 0.8)")


if __name__ == "__main__":
    main()
