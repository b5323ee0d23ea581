"""BM25 at query time (beyond the paper): the document as the query over the images' own text (W/lexical).

Three uses, one method each (`cfir_jax.retrieve.methods`): `bm25` answers with BM25's top `retrieval.lexical.top_k`;
`cfir_bm25` adds each document's top M (`retrieval.lexical.candidates`) to CFIR's candidate union, which SR scores
like any other candidate; `cfir_bm25_fused` fuses SR's ranking with BM25's by reciprocal rank,
w_sr / (rrf_k + rank_sr) + fuse_weight / (rrf_k + rank_bm25) with w_sr = 1 (a list an image is missing from adds
nothing). Removed images are dropped inside the search (`cfir_jax.search.bm25`), so no use returns one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cfir_jax.core.errors import CfirError
from cfir_jax.core.languages import REFERENCE
from cfir_jax.search.bm25 import BM25Search, Pruning, Ranked, top_k
from cfir_jax.search.live_rows import LiveRows
from cfir_jax.search.topk import unique_sorted
from cfir_jax.stores.lexical import LexicalIndex


class LexicalSearch:
    """The search of the lexical store of a workdir (opened checked against its image cache: `cfir_jax.stores.lexical`
    `READER`) over the live rows."""

    def __init__(self, rcfg, store: LexicalIndex, live, languages=None, fitted=None):
        self.cfg, self.store = rcfg.lexical, store
        # A query's terms also as each caption language reads them (index.languages.query_stemming; `languages`).
        self.union = languages is None or languages.query_stemming == "union"
        # SR's weight in the convex fusion: the config's, else the fitted store's (cfir_jax.stores.convex_fusion)
        self.alpha = float(self.cfg.alpha) if float(self.cfg.alpha) >= 0 else fitted.alpha if fitted else None
        self.fitted = fitted
        if not (float(self.cfg.alpha) == -1 or 0 <= float(self.cfg.alpha) <= 1):
            raise CfirError(f"retrieval.lexical.alpha={self.cfg.alpha}: SR's weight in the convex fusion, in [0, 1] "
                            "(-1: the one retrieve.py --fit-fusion fitted)")
        if int(self.cfg.top_k) < 1 or int(self.cfg.candidates) < 0 or float(self.cfg.fuse_weight) < 0:
            raise CfirError(f"retrieval.lexical: top_k={self.cfg.top_k} must be >= 1, candidates="
                            f"{self.cfg.candidates} and fuse_weight={self.cfg.fuse_weight} >= 0")
        pruning = Pruning(int(self.cfg.max_terms), int(self.cfg.max_postings))
        self.search = BM25Search(self.store.indptr, self.store.indices, self.store.data, self.store.num_rows,
                                 live=live, pruning=pruning)

    def search_many(self, texts: Sequence[str], k: int | None = None, langs: Sequence[str | None] = (),
                    live: LiveRows | None = None) -> list[Ranked]:
        """Each text's top k (default retrieval.lexical.top_k) images of `live` (None: the version's live rows):
        (scores, rows), best first; `langs`: each text's language (English where not given)."""
        k = int(k or self.cfg.top_k)
        langs = list(langs) + [None] * (len(texts) - len(langs))
        return [self.search.search(*self.store.query_terms(t, lang or REFERENCE, self.union), k, live)
                for t, lang in zip(texts, langs)]

    def search_docs(self, docs, live: LiveRows) -> list[Ranked]:
        """`search_many` of documents (each with its `text` and `lang`, as retrieval's DocumentInput) over the rows
        `live` (the call's)."""
        return self.search_many([d.text for d in docs], langs=[d.lang for d in docs], live=live)

    def model_note(self, methods) -> str:
        """What a CFIR row adds to its model column (the --compare table)."""
        if methods.lexical_candidates:
            return f", BM25 top {self.cfg.candidates} in the union"
        if methods.convex:
            where = f"fitted on {self.fitted.split}" if self.alpha == getattr(self.fitted, "alpha", None) \
                else "retrieval.lexical.alpha"
            return f", fused with BM25 (convex, alpha={self.alpha:g}, {where})"
        return f", fused with BM25 (RRF, weight {float(self.cfg.fuse_weight):g})"

    def grow(self, union: np.ndarray, ranked: Ranked) -> tuple[int, np.ndarray]:
        """(rows added, ER's sorted union with the document's top M BM25 rows)."""
        grown = unique_sorted(np.concatenate([union, ranked[1][: int(self.cfg.candidates)]]))
        return len(grown) - len(union), grown

    def fuse_all(self, ranked: list, lexical: list[Ranked], k: int, convexly: bool = False) -> None:
        """Each document's SR ranking (`ranked[i].ranked`) fused with its BM25 ranking (reciprocal rank, module
        docstring; `convexly`: their convex combination with SR's weight `alpha`, `convex`), top k, in place;
        `added`: BM25's rows the union had not held."""
        alpha = self.alpha if convexly else None
        for r, bm25 in zip(ranked, lexical):
            held = r.union if r.union is not None else r.ranked[1]
            r.ranked = rrf(r.ranked, bm25, float(self.cfg.fuse_weight), int(self.cfg.rrf_k), k) if alpha is None \
                else convex(r.ranked, bm25, alpha, k)
            r.added = len(np.setdiff1d(bm25[1], held))


def label(store: LexicalIndex, cfg) -> str:
    """The bm25 method's model column (the --compare table): the store's BM25 and retrieval.lexical's pruning."""
    m = store.manifest
    pruned = f"rarest {cfg.max_terms} terms, {cfg.max_postings:,} postings" if cfg.max_terms or cfg.max_postings \
        else "every term"
    return f"BM25 {m['method']} k1={m['k1']:g} b={m['b']:g} over image text ({pruned})"


def minmax(scores: np.ndarray) -> np.ndarray:
    """Scores scaled to [0, 1] over their list (all 1 when they are equal)."""
    scores = np.asarray(scores, np.float64)
    lo, hi = (scores.min(), scores.max()) if len(scores) else (0.0, 0.0)
    return (scores - lo) / (hi - lo) if hi > lo else np.ones(len(scores))


def convex(first: Ranked, second: Ranked, alpha: float, k: int) -> Ranked:
    """alpha * minmax(first) + (1 - alpha) * minmax(second) over the rows of both; a row one list lacks scores 0
    there (Bruch et al., TOIS 2023: the convex combination of normalised scores)."""
    scores = np.concatenate([alpha * minmax(first[0][first[1] >= 0]) if len(first[1]) else np.zeros(0),
                             (1 - alpha) * minmax(second[0][second[1] >= 0]) if len(second[1]) else np.zeros(0)])
    rows = np.concatenate([first[1][first[1] >= 0], second[1][second[1] >= 0]]).astype(np.int64)
    uniq, inverse = np.unique(rows, return_inverse=True)
    fused = np.bincount(inverse, weights=scores, minlength=len(uniq))
    return top_k(fused.astype(np.float32), uniq.astype(np.int32), k)


def rrf(first: Ranked, second: Ranked, weight: float, rrf_k: int, k: int) -> Ranked:
    """1 / (rrf_k + rank in first) + weight / (rrf_k + rank in second), ranks from 1, over the rows of both."""
    rows = np.concatenate([first[1], second[1]]).astype(np.int64)
    scores = np.concatenate([1.0 / (rrf_k + np.arange(1, len(first[1]) + 1)),
                             weight / (rrf_k + np.arange(1, len(second[1]) + 1))])
    keep = rows >= 0
    uniq, inverse = np.unique(rows[keep], return_inverse=True)
    fused = np.bincount(inverse, weights=scores[keep], minlength=len(uniq))
    return top_k(fused.astype(np.float32), uniq.astype(np.int32), k)
