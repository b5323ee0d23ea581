"""Fitting the convex fusion's weight (`python retrieve.py --index W --fit-fusion`) on the train split, and writing the
store W/convex_fusion that `cfir_jax.stores.convex_fusion` reads (beyond the paper).

For every train document, full CFIR's SR list and BM25's list (exact SR, the settings of the --compare row
`CFIR + BM25 convex`, `cfir_jax.eval.comparison.CONVEX`) are computed once; then each weight alpha of a grid over
[0, 1] fuses them (`cfir_jax.retrieve.lexical.convex`) and the train MRR@10 of the fused lists is measured. The best
alpha is kept (ties: the one nearest 0.5). Bruch, Gai & Ingber (TOIS 2023) find a few labelled queries enough to fit it.
"""

from __future__ import annotations

import time

import ml_collections
import numpy as np

from cfir_jax.api.index import Index
from cfir_jax.core.config_upgrade import upgrade
from cfir_jax.core.errors import CfirError
from cfir_jax.eval import metrics
from cfir_jax.eval.comparison import CONVEX
from cfir_jax.retrieve.lexical import LexicalSearch, convex
from cfir_jax.stores import lexical
from cfir_jax.stores.contract import atomic_dir, write_manifest
from cfir_jax.stores.convex_fusion import FORMAT_VERSION, KIND

GRID = tuple(round(a, 2) for a in np.linspace(0.0, 1.0, 21))


def fit_fusion(config: ml_collections.ConfigDict, workdir, progress: bool = True, split: str = "train") -> dict:
    """Fits alpha on `split` of `workdir` and writes W/convex_fusion; returns its manifest."""
    start = time.time()
    cfg = CONVEX.config(upgrade(config.copy_and_resolve_references()))
    cfg.retrieval.sr = cfg.retrieval.eval_sr
    retriever = Index(cfg, workdir, "cfir").retriever()
    if split not in retriever.corpus.splits:
        raise CfirError(f"{retriever.layout.corpus}: no {split} split to fit the fusion on")
    docs = retriever.corpus_documents(split)
    results = retriever.retrieve_many(docs, progress=progress)
    sr = [(np.array([h.score for h in r.hits], np.float32), np.array([h.row for h in r.hits], np.int32))
          for r in results]
    search = LexicalSearch(cfg.retrieval, lexical.READER.open_for(retriever.stores), retriever.stores.live)
    bm25 = search.search_many([d.text for d in docs])
    qrels, ids, k = retriever.corpus.qrels(split), retriever.image_ids, int(cfg.retrieval.top_k)
    mrr = {}
    for alpha in GRID:
        run = {d.doc_id: [(ids[int(row)], float(s)) for s, row in zip(*convex(a, b, alpha, k))]
               for d, a, b in zip(docs, sr, bm25)}
        mrr[alpha] = round(metrics.evaluate(run, qrels, measures=("mrr@10",), complete=True).aggregate["mrr@10"], 4)
    best = max(GRID, key=lambda a: (mrr[a], -abs(a - 0.5)))
    with atomic_dir(retriever.layout.convex_fusion) as tmp:
        manifest = write_manifest(tmp, KIND, FORMAT_VERSION, alpha=float(best), split=split, documents=len(docs),
                                  mrr10={f"{a:g}": mrr[a] for a in GRID},
                                  cache_fingerprint=retriever.cache.content_fingerprint,
                                  fit_seconds=round(time.time() - start, 1))
    return manifest


def summary(m: dict, workdir) -> str:
    """What the fit did, in one line."""
    grid, best = m["mrr10"], f"{m['alpha']:g}"
    return (f"fusion: alpha={best} (SR's weight) fitted on {m['documents']:,} {m['split']} documents, MRR@10 "
            f"{grid[best]:.4f} (alpha=0: {grid['0']:.4f}, 1: {grid['1']:.4f}); wrote {workdir}/convex_fusion; "
            "its row: retrieve.py --evaluate test --compare, or --method cfir_bm25_convex")
