"""Fitting the convex fusions' weights (`python retrieve.py --index W --fit-fusion`) on the train split, and writing the
store W/convex_fusion that `cfir_jax.stores.convex_fusion` reads (beyond the paper). Each pair whose store the
workdir holds is fitted:

- `bm25` (W/lexical): for every train document, full CFIR's SR list and BM25's list (exact SR, the settings of the
  --compare row `CFIR + BM25 convex`, `cfir_jax.eval.comparison.CONVEX`) are computed once; then each weight alpha
  of a grid over [0, 1] fuses them (`cfir_jax.retrieve.lexical.convex`);
- `image_text` (W/image_text): for every train document, the image and image-text scores of ER's whole union (the
  row `CFIR + image text convex`, `cfir_jax.eval.comparison.TEXT_CONVEX`) are computed once; then each alpha ranks
  the union by their convex fusion (`cfir_jax.retrieve.text_fusion`); a document without a usable entity keeps
  CFIR's fallback, whatever alpha.

For each alpha the train MRR@10 of the fused lists is measured, and the best alpha is kept (ties: the one nearest
0.5). Bruch, Gai & Ingber (TOIS 2023) find a few labelled queries enough to fit it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import ml_collections
import numpy as np

from cfir_jax.api.index import Index
from cfir_jax.core.config_upgrade import upgrade
from cfir_jax.core.errors import CfirError
from cfir_jax.eval import metrics
from cfir_jax.eval.comparison import CONVEX, TEXT_CONVEX
from cfir_jax.retrieve.lexical import convex
from cfir_jax.retrieve.results import Result
from cfir_jax.retrieve.text_fusion import fuse
from cfir_jax.stores.contract import atomic_dir, write_manifest
from cfir_jax.stores.convex_fusion import FORMAT_VERSION, KIND
from cfir_jax.stores.image_cache import ImageCache
from cfir_jax.stores.layout import Layout

GRID = tuple(round(a, 2) for a in np.linspace(0.0, 1.0, 21))
CUT = 10  # the fit's measure is MRR@10
Ranked = tuple[np.ndarray, np.ndarray]


def _index(config: ml_collections.ConfigDict, workdir, row, method: str, split: str) -> tuple[Index, list]:
    """The index of `method` under the settings of --compare's `row` (exact SR), and the documents of `split`."""
    cfg = row.config(upgrade(config.copy_and_resolve_references()))
    cfg.retrieval.sr = cfg.retrieval.eval_sr
    index = Index(cfg, workdir, method)
    index.qrels(split)  # one line when the corpus has no such split to fit on
    return index, index.corpus_documents(split)


def _ranked(result: Result) -> Ranked:
    return np.array([h.score for h in result.hits], np.float32), np.array(result.rows, np.int32)


def head(ranked: Ranked, cut: int = CUT) -> Ranked:
    """The hits of a list that can be among its first `cut` ranks: every hit scoring at least its cut-th best score.
    trec_eval ranks by score (ties by id), so a hit below that score ranks after `cut` others and never changes
    MRR@cut: the head gives the whole list's MRR@cut to the last bit, without a thousand hits per document for each
    alpha of the grid."""
    scores, rows = ranked
    if len(scores) <= cut:
        return ranked
    keep = scores >= np.partition(scores, len(scores) - cut)[len(scores) - cut]
    return scores[keep], rows[keep]


def _sweep(index: Index, docs: list, split: str, fused: Callable[[int, float], Ranked]) -> dict:
    """The fit of one pair: fused(i, alpha) is document i's list at weight alpha; MRR@10 on `split` at each."""
    qrels, ids = index.qrels(split), index.image_ids
    mrr = {}
    for alpha in GRID:
        run = {d.doc_id: [(ids[int(row)], float(s)) for s, row in zip(*head(fused(i, alpha)))]
               for i, d in enumerate(docs)}
        measure = f"mrr@{CUT}"
        mrr[alpha] = round(metrics.evaluate(run, qrels, measures=(measure,), complete=True).aggregate[measure], 4)
    best = max(GRID, key=lambda a: (mrr[a], -abs(a - 0.5)))
    return {"alpha": float(best), "split": split, "documents": len(docs), "mrr10": {f"{a:g}": mrr[a] for a in GRID}}


def fit_bm25(config: ml_collections.ConfigDict, workdir, progress: bool, split: str) -> dict:
    """SR's weight against BM25's."""
    index, docs = _index(config, workdir, CONVEX, "cfir", split)  # SR's own list, fused below
    sr = [_ranked(r) for r in index.retrieve(docs, progress=progress)]
    bm25 = index.bm25_lists([d.text for d in docs])
    k = index.max_top_k
    return _sweep(index, docs, split, lambda i, alpha: convex(sr[i], bm25[i], alpha, k))


def fit_image_text(config: ml_collections.ConfigDict, workdir, progress: bool, split: str) -> dict:
    """The image's weight against its own text's, over ER's union."""
    row = TEXT_CONVEX.with_overrides(retrieval__fusion__alpha=0.5)  # any weight: the sweep re-fuses what is kept
    index, docs = _index(config, workdir, row, row.method, split)
    results, kept = index.retrieve_with_unions(docs, progress)  # each union and its two scores (None: no entity)
    k = index.max_top_k
    return _sweep(index, docs, split,
                  lambda i, alpha: _ranked(results[i]) if kept[i] is None else fuse(*kept[i], alpha, k))


# The pairs, each fitted when its store is there: (pair, the store it needs, its fit).
FITS = (("bm25", "lexical", fit_bm25), ("image_text", "image_text", fit_image_text))


def fit_fusion(config: ml_collections.ConfigDict, workdir, progress: bool = True, split: str = "train") -> dict:
    """Fits each pair's alpha on `split` of `workdir` and writes W/convex_fusion; returns its manifest."""
    start, layout = time.time(), Layout.of(workdir)
    pairs = {name: fit(config, workdir, progress, split) for name, store, fit in FITS
             if (getattr(layout, store) / "manifest.json").is_file()}
    if not pairs:
        raise CfirError(f"{layout.root}: nothing to fuse convexly: no W/lexical (BM25) and no W/image_text; build "
                        "either with index.py (index.lexical.enabled, index.image_text.enabled)")
    cache = ImageCache.open(layout.image_cache).content_fingerprint
    with atomic_dir(layout.convex_fusion) as tmp:  # bm25's fit also at the top level, as older stores held it
        manifest = write_manifest(tmp, KIND, FORMAT_VERSION, **pairs.get("bm25", {}), pairs=pairs,
                                  cache_fingerprint=cache, fit_seconds=round(time.time() - start, 1))
    return manifest


def summary(m: dict, workdir) -> str:
    """What the fit did: one line per pair fitted, then where it went."""
    whose = {"bm25": "SR's weight", "image_text": "the image's weight, against its own text's"}
    lines = []
    for name, fit in (m.get("pairs") or {"bm25": m}).items():
        grid, best = fit["mrr10"], f"{fit['alpha']:g}"
        lines.append(f"fusion: alpha={best} ({whose[name]}) fitted on {fit['documents']:,} {fit['split']} documents, "
                     f"MRR@10 {grid[best]:.4f} (alpha=0: {grid['0']:.4f}, 1: {grid['1']:.4f})")
    return "\n".join([*lines, f"wrote {workdir}/convex_fusion; its rows: retrieve.py --evaluate test --compare, or "
                                "--method cfir_bm25_convex / cfir_text_convex"])
