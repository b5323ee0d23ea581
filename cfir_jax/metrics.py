"""Retrieval metrics with trec_eval's exact semantics, in plain Python and numpy.

What trec_eval does, and so what `evaluate` does (checked against trec_eval 9.x sources and pytrec_eval):
  * A run is ranked by score descending, ties broken by docid in descending strcmp order; the order the hits are
    given in, and any rank column, are ignored.
  * A document is relevant when its qrels rel >= 1 (trec_eval's default -l 1); rel <= 0 and unjudged documents
    are not relevant. Topics are evaluated when they appear in the qrels (with at least one judgment, of any value)
    and in the run (with at least one hit). Topics in the run but not in the qrels are ignored. A topic whose
    judgments are all non-relevant IS evaluated by trec_eval and scores 0 on every measure here (it counts in the
    mean), exactly as trec_eval and pytrec_eval do.
  * The aggregate is the mean over evaluated topics. `complete=True` is trec_eval -c: every qrels topic counts,
    those missing from the run with value 0 (trec_eval divides by the number of qrels topics).
  * trec_eval has no recip_rank cutoff; MRR@k is what `trec_eval -M k -m recip_rank` reports: recip_rank over the
    top k of the trec_eval ranking (0 when no relevant document is in the top k). Since -M truncates after sorting,
    this equals recip_rank when the first relevant rank is <= k and 0 otherwise.

Measures (name -> trec_eval / pytrec_eval name):
  mrr@k -> recip_rank with -M k;  mrr -> recip_rank;  recall@k -> recall.k (recall_k);  success@k -> success.k;
  ndcg@k -> ndcg_cut.k (gain = rel, discount log2(rank + 1));  p@k -> P.k.
trec_eval spellings (recip_rank, recall.1000, recall_1000, success.10, ndcg_cut.10, P.10) are accepted too; results
are keyed by the name given.

Speed: only the ranks of retrieved relevant documents are needed, and a rank is one vectorised count over the
topic's scores (plus a docid comparison among exact ties), so no topic is fully sorted: 20k topics x 1000 hits
evaluate in about a second.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence

import numpy as np

from cfir_jax.errors import CfirError

DEFAULT_MEASURES = ("mrr@10", "recall@10", "recall@100", "recall@1000", "success@1000")

_KINDS = ("mrr", "recall", "success", "ndcg", "p")
_OURS = re.compile(r"^(mrr|recall|success|ndcg|p)@([0-9]+)$", re.IGNORECASE)
_TREC = re.compile(r"^(recall|success|ndcg_cut|P)[._]([0-9]+)$")
_TREC_KIND = {"recall": "recall", "success": "success", "ndcg_cut": "ndcg", "P": "p"}


@dataclasses.dataclass(frozen=True)
class Measure:
    """One parsed measure: `kind` in mrr/recall/success/ndcg/p, `cutoff` a rank (None: whole ranking, mrr only)."""

    name: str
    kind: str
    cutoff: int | None


def parse_measure(name: str) -> Measure:
    """Parses "mrr@10", "recall@1000", ... or a trec_eval spelling ("recall.1000", "recip_rank"); CfirError if unknown."""
    if name in ("mrr", "recip_rank"):
        return Measure(name, "mrr", None)
    match = _OURS.match(name)
    if match:
        kind, cutoff = match.group(1).lower(), int(match.group(2))
    else:
        match = _TREC.match(name)
        if not match:
            raise CfirError(
                f"unknown measure {name!r}; use mrr@k, recall@k, success@k, ndcg@k, p@k or mrr "
                "(or trec_eval names recip_rank, recall.k, success.k, ndcg_cut.k, P.k)"
            )
        kind, cutoff = _TREC_KIND[match.group(1)], int(match.group(2))
    if cutoff < 1:
        raise CfirError(f"measure {name!r}: the cutoff must be a positive rank")
    return Measure(name, kind, cutoff)


@dataclasses.dataclass
class EvalResult:
    """Per-topic values and their mean, keyed by measure name as requested.

    per_query: {qid: {measure: value}} for every evaluated topic (with complete=True, qrels topics missing from
      the run appear with 0.0). aggregate: {measure: mean over per_query}. num_queries: len(per_query).
    """

    per_query: dict[str, dict[str, float]]
    aggregate: dict[str, float]
    measures: tuple[str, ...]
    num_queries: int
    complete: bool = False

    def table(self, per_query: bool = False) -> str:
        """trec_eval-style text: `measure  qid  value` lines, the aggregate under qid `all` (after topics if asked)."""
        width = max(len(m) for m in (*self.measures, "num_q"))
        rows = []
        if per_query:
            for qid, values in self.per_query.items():
                rows += [f"{m:<{width}}\t{qid}\t{values[m]:.4f}" for m in self.measures]
        rows.append(f"{'num_q':<{width}}\tall\t{self.num_queries}")
        rows += [f"{m:<{width}}\tall\t{self.aggregate[m]:.4f}" for m in self.measures]
        return "\n".join(rows)


def _topic_scores(qid: str, hits) -> dict[str, float] | Mapping[str, float]:
    """A topic's hits as a docid -> score mapping; a sequence of pairs with a repeated docid is refused."""
    if isinstance(hits, Mapping):
        return hits
    pairs = [tuple(h) for h in hits]
    scores = dict(pairs)
    if len(scores) != len(pairs):
        seen: set = set()
        dup = next(d for d, _ in pairs if d in seen or seen.add(d))
        raise CfirError(f"run topic {qid}: docid {dup} appears twice; trec_eval refuses duplicate hits")
    return scores


def _relevant_ranks(qid: str, hits: Mapping[str, float], judged: Mapping[str, int]) -> list[tuple[int, int]]:
    """Sorted (rank, rel) of the retrieved relevant documents, ranks as trec_eval assigns them (1-based)."""
    try:
        scores = np.fromiter(hits.values(), dtype=np.float64, count=len(hits))
    except (TypeError, ValueError):
        raise CfirError(f"run topic {qid}: a score is not a number") from None
    if np.isnan(scores).any():
        raise CfirError(f"run topic {qid}: a score is NaN; trec_eval cannot rank it")
    keys = None
    ranked = []
    for docid, rel in judged.items():
        if rel < 1 or docid not in hits:
            continue
        score = float(hits[docid])
        # Rank = 1 + hits ranked above: higher score, or equal score and a larger docid (strcmp descending).
        rank = 1 + int(np.count_nonzero(scores > score))
        tied = np.flatnonzero(scores == score)
        if len(tied) > 1:
            keys = keys if keys is not None else list(hits)
            rank += sum(1 for i in tied if keys[i] > docid)
        ranked.append((rank, rel))
    ranked.sort()
    return ranked


def _dcg(gains_by_rank: Sequence[tuple[int, int]], cutoff: int) -> float:
    """Sum of gain / log2(rank + 1) over ranks <= cutoff, accumulated in rank order as trec_eval does."""
    total = 0.0
    for rank, gain in gains_by_rank:
        if rank > cutoff:
            break
        total += gain / math.log2(rank + 1)
    return total


def _topic_values(ranked: list[tuple[int, int]], judged: Mapping[str, int], measures: list[Measure]) -> dict:
    """Values of `measures` for one topic from the (rank, rel) of its retrieved relevant documents."""
    num_rel = sum(1 for rel in judged.values() if rel >= 1)
    first = ranked[0][0] if ranked else None
    ideal = None
    values = {}
    for m in measures:
        k = m.cutoff
        if m.kind == "mrr":
            value = 1.0 / first if first is not None and (k is None or first <= k) else 0.0
        elif m.kind == "recall":
            value = sum(1 for r, _ in ranked if r <= k) / num_rel if num_rel else 0.0
        elif m.kind == "success":
            value = 1.0 if first is not None and first <= k else 0.0
        elif m.kind == "p":
            value = sum(1 for r, _ in ranked if r <= k) / k
        else:  # ndcg: ideal ranking = all positive judgments by gain descending
            if ideal is None:
                ideal = list(enumerate(sorted((rel for rel in judged.values() if rel > 0), reverse=True), 1))
            best = _dcg(ideal, k)
            value = _dcg(ranked, k) / best if best > 0 else 0.0
        values[m.name] = value
    return values


def evaluate(
    run: Mapping[str, Mapping[str, float]] | Mapping[str, Sequence[tuple[str, float]]],
    qrels: Mapping[str, Mapping[str, int]],
    measures: Sequence[str] = DEFAULT_MEASURES,
    complete: bool = False,
) -> EvalResult:
    """Evaluates `run` against `qrels` exactly as trec_eval does (see the module docstring).

    run: {qid: {docid: score}} (as `trec.read_run` returns) or {qid: [(docid, score), ...]}; any number of hits.
    qrels: {qid: {docid: rel}} (as `trec.read_qrels` returns). complete: trec_eval -c.
    Raises CfirError for an unknown measure, a NaN score, or when no topic is in both run and qrels.
    """
    if isinstance(measures, str):
        measures = (measures,)
    parsed = [parse_measure(m) for m in measures]
    if len({m.name for m in parsed}) != len(parsed):
        raise CfirError(f"measures {list(measures)} name one measure twice")
    per_query: dict[str, dict[str, float]] = {}
    # trec_eval walks the qrels topics in strcmp order; keep that order so sums match to the last bit.
    for qid in sorted(q for q, judged in qrels.items() if judged):
        judged = qrels[qid]
        hits = run.get(qid)
        hits = _topic_scores(qid, hits) if hits is not None else None
        if not hits:
            if complete:
                per_query[qid] = {m.name: 0.0 for m in parsed}
            continue
        per_query[qid] = _topic_values(_relevant_ranks(qid, hits, judged), judged, parsed)
    if not per_query:
        raise CfirError(
            f"no topic is in both the run ({len(run)} topics) and the qrels ({len(qrels)} topics); "
            "check that the run and qrels are for the same split and use the same ids"
        )
    aggregate = {}
    for m in parsed:
        total = 0.0
        for values in per_query.values():
            total += values[m.name]
        aggregate[m.name] = total / len(per_query)
    return EvalResult(per_query, aggregate, tuple(m.name for m in parsed), len(per_query), complete)
