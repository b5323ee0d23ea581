"""Bulk retrieval throughput: documents/s end to end and SR queries/s, batched against one at a time, in one run.

    python benchmarks/bulk_retrieval.py --workdir demo_work              # built by `bash scripts/demo.sh`
    python benchmarks/bulk_retrieval.py --workdir demo_work --docs 400 --batch-size 128 --entity-workers 2

End to end: the Retriever on `--docs` fresh documents of a split (entities and summaries recomputed), once as the
one-at-a-time loop (`retrieve_many([doc])` per document, what retrieve.py did per query) and once in bulk
(`retrieve_many(docs)`: batches of `--batch-size`, one spaCy stream with `--entity-workers` processes, batched
encoding and SR). The two must return the same hits; the script checks it. SR alone: the same documents' summary
embeddings and candidate unions scored one query per call and as one batch, on the CPU scorer and on the device
path (whatever JAX backend is present).
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import numpy as np
from common import hardware_description  # also puts the repository root on sys.path

from cfir_jax.core.cli import cli_main
from cfir_jax.core.errors import CfirError


def load_averages() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def _retriever(config, workdir: str, entity_workers: int | None = None, **retrieval):
    from cfir_jax.retrieve.pipeline import Retriever

    cfg = copy.deepcopy(config)
    cfg.retrieval.update(retrieval)
    if entity_workers is not None:
        cfg.entity_workers.bulk = entity_workers
    return Retriever(cfg, workdir, "cfir")


def end_to_end(config, args) -> list:
    """Loop vs bulk on fresh documents; returns the stored documents used (for the SR part)."""
    from cfir_jax.retrieve.pipeline import DocumentInput

    loop = _retriever(config, args.workdir, sr_backend="cpu")
    stored = loop.corpus_documents(args.split)[: args.docs]
    if len(stored) < 2:
        raise CfirError(f"{args.workdir}: split {args.split!r} has {len(stored)} documents; need 2 or more")
    fresh = [DocumentInput(d.text, d.doc_id) for d in stored]
    bulk = _retriever(config, args.workdir, sr_backend="cpu", batch_size=args.batch_size,
                      entity_workers=args.entity_workers)
    loop.retrieve_many(fresh[:1])  # warm-up: spaCy, summarizer, encoder compiles, the SR scorer
    bulk.retrieve_many(fresh[:1])
    t0 = time.perf_counter()
    one = [loop.retrieve_many([d])[0] for d in fresh]
    t_loop = time.perf_counter() - t0
    t0 = time.perf_counter()
    many = bulk.retrieve_many(fresh, progress=True)
    t_bulk = time.perf_counter() - t0
    same = all([h.row for h in a.hits] == [h.row for h in b.hits] for a, b in zip(one, many))
    print(f"end to end, {len(fresh)} fresh {args.split} documents (entities and summaries recomputed):")
    print(f"  one at a time: {len(fresh) / t_loop:8.2f} documents/s  ({t_loop:.1f} s)")
    print(f"  bulk (batches of {args.batch_size}, {args.entity_workers} spaCy worker(s)): {len(fresh) / t_bulk:8.2f} "
          f"documents/s  ({t_bulk:.1f} s) -> {t_loop / t_bulk:.2f}x; same hits as the loop: {same}")
    if args.compare_worker_start and args.entity_workers > 1:
        worker_start(bulk, fresh, many)
    return stored


def worker_start(bulk, fresh, reference) -> None:
    """Bulk documents/s with spaCy's workers forked from this JAX process by nlp.pipe afresh per call (the old way:
    Python warns it may deadlock) against the persistent pool (now: `cfir_jax.nlp.entity_workers`), alternating, two
    runs each; the pool's first run includes its start (workers started, pipelines loaded), its second does not."""
    ranking = bulk.entities

    class Forked:  # the old way, as `EntityRanking.stream` did it before the pool: spaCy's own n_process, forked
        def stream(self, texts, chunk):
            extractor = ranking.extractor()
            for doc in extractor.nlp.pipe(texts, batch_size=extractor.batch_size,
                                          n_process=int(bulk.config.entity_workers.bulk)):
                yield extractor.entities_of_doc(doc)

    if ranking._pool is not None:  # the pool's first run below starts it afresh
        ranking._pool.close()
        ranking._pool = None
    rates: dict[str, list[float]] = {"fork": [], "pool": []}
    same = True
    for _ in range(2):
        for method in rates:
            if method == "fork":
                ranking.workers = Forked  # shadows the method: workers() -> a Forked
            else:
                del ranking.workers
            t0 = time.perf_counter()
            out = bulk.retrieve_many(fresh)
            rates[method].append(len(fresh) / (time.perf_counter() - t0))
            same &= all([h.row for h in a.hits] == [h.row for h in b.hits] for a, b in zip(out, reference))
    fork, pool = max(rates["fork"]), rates["pool"]
    print(f"  spaCy workers, bulk documents/s (alternating): forked per call (best of 2) {fork:.2f}; persistent "
          f"pool {pool[0]:.2f} with its start, {pool[1]:.2f} started -> pool / fork = {pool[0] / fork:.3f} "
          f"with its start, {pool[1] / fork:.3f} started; same hits: {same}")


def sr_only(config, args, docs) -> None:
    """SR queries/s: one query per call vs one batch, CPU scorer and device path, on the documents' real unions."""
    from cfir_jax.search.topk import unique_sorted

    r = _retriever(config, args.workdir, sr_backend="cpu")
    queries = r.query_encoder.encode([d.summary for d in docs])
    unions, keep = [], []
    for i, d in enumerate(docs):
        lists, _, _ = r._candidates(d.entities)
        if lists:
            unions.append(unique_sorted(np.concatenate(lists).astype(np.int32)))
            keep.append(i)
    queries = queries[keep]
    print(f"SR alone: {len(unions)} queries, {np.mean([len(u) for u in unions]):,.0f} unique candidates on average, "
          f"cache {r.cache.num_images:,} x {r.cache.dim}, top-{r.rcfg.top_k}")
    import jax

    scorers = {"cpu (sr_scorer)": r.sr_scorer(),
               f"device ({jax.default_backend()}, sr_device)": _retriever(config, args.workdir,
                                                                          sr_backend="device").sr_scorer()}
    for name, scorer in scorers.items():
        scorer.score_batch(queries[:1], unions[:1])  # warm-up / compile
        scorer.score_batch(queries, unions)
        t0 = time.perf_counter()
        one = [scorer.score_batch(q[None], [u])[0] for q, u in zip(queries, unions)]
        t_one = time.perf_counter() - t0
        t0 = time.perf_counter()
        batched = scorer.score_batch(queries, unions)
        t_batch = time.perf_counter() - t0
        same = all(np.array_equal(a[1], b[1]) for a, b in zip(one, batched))
        print(f"  {name:28s} one per call {len(unions) / t_one:9.1f} queries/s   batched {len(unions) / t_batch:9.1f} "
              f"queries/s ({t_one / t_batch:.2f}x); same results: {same}")


@cli_main
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True, help="workdir built by index.py + train.py")
    p.add_argument("--config", help="config file (default: the one in the workdir's index.json)")
    p.add_argument("--split", default="test")
    p.add_argument("--docs", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--entity-workers", type=int, default=2)
    p.add_argument("--compare-worker-start", action="store_true", help="also time bulk retrieval with spaCy's "
                   "workers forked (the old way) against started from a forkserver")
    args = p.parse_args()
    if min(args.docs, args.batch_size, args.entity_workers) < 1:
        raise CfirError("--docs, --batch-size and --entity-workers must be >= 1")
    from cfir_jax.core import cli

    config = cli.load_config_file(args.config) if args.config else cli.workdir_config(args.workdir)
    print(hardware_description())
    print(f"load average (1/5/15 min) at start {load_averages()}")
    docs = end_to_end(config, args)
    sr_only(config, args, docs)
    print(f"load average at the end {load_averages()}")


if __name__ == "__main__":
    main()
