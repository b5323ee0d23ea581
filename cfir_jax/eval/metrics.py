"""Retrieval metrics computed by trec_eval itself (through pytrec_eval), keyed by the names the project uses.

What trec_eval does, and so what `evaluate` returns:
  * A run is ranked by score descending, ties broken by docid in descending strcmp order; the order the hits are
    given in, and any rank column, are ignored.
  * A document is relevant when its qrels rel >= 1 (trec_eval's default -l 1). Topics are evaluated when they are in
    the qrels (with at least one judgment) and in the run (with at least one hit); a topic judged only non-relevant
    is evaluated and scores 0. The aggregate is the mean over evaluated topics; `complete=True` is trec_eval -c
    (qrels topics missing from the run count as 0), which pytrec_eval lacks, so it is added here.
  * trec_eval has no recip_rank cutoff: MRR@k is what `trec_eval -M k -m recip_rank` reports, recip_rank over the
    run cut at rank k. -M cuts after ranking, so it is recip_rank when the first relevant rank (1 / recip_rank) is
    <= k and 0 otherwise; that is how it is derived from pytrec_eval's full-run recip_rank.

Measures (name -> trec_eval name): mrr@k -> recip_rank with -M k; mrr -> recip_rank; recall@k -> recall.k;
success@k -> success.k; ndcg@k -> ndcg_cut.k; p@k -> P.k. trec_eval spellings (recip_rank, recall.1000,
recall_1000, success.10, ndcg_cut.10, P.10) are accepted too; results are keyed by the name given.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence

import pytrec_eval

from cfir_jax.errors import CfirError

DEFAULT_MEASURES = ("mrr@10", "recall@10", "recall@100", "recall@1000", "success@1000")

_OURS = re.compile(r"^(mrr|recall|success|ndcg|p)@([0-9]+)$", re.IGNORECASE)
_TREC = re.compile(r"^(recall|success|ndcg_cut|P)[._]([0-9]+)$")
_TREC_KIND = {"recall": "recall", "success": "success", "ndcg_cut": "ndcg", "P": "p"}
_TREC_NAME = {kind: name for name, kind in _TREC_KIND.items()}


@dataclasses.dataclass(frozen=True)
class Measure:
    """One parsed measure: `kind` in mrr/recall/success/ndcg/p, `cutoff` a rank (None: whole ranking, mrr only)."""

    name: str
    kind: str
    cutoff: int | None


def parse_measure(name: str) -> Measure:
    """Parses "mrr@10", "recall@1000", ... or a trec_eval spelling ("recall.1000", "recip_rank"); CfirError if not."""
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


def _topic_scores(qid: str, hits) -> dict[str, float]:
    """A topic's hits as docid -> float score (what pytrec_eval takes); repeated docids and NaN scores refused."""
    pairs = hits.items() if isinstance(hits, Mapping) else [tuple(h) for h in hits]
    try:
        scores = {docid: float(score) for docid, score in pairs}
    except (TypeError, ValueError):
        raise CfirError(f"run topic {qid}: a score is not a number") from None
    if len(scores) != len(pairs):
        seen: set = set()
        dup = next(d for d, _ in pairs if d in seen or seen.add(d))
        raise CfirError(f"run topic {qid}: docid {dup} appears twice; trec_eval refuses duplicate hits")
    if any(math.isnan(v) for v in scores.values()):
        raise CfirError(f"run topic {qid}: a score is NaN; trec_eval cannot rank it")
    return scores


def _trec_measure(m: Measure) -> tuple[str, str]:
    """(the pytrec_eval measure to request, the key of its value in pytrec_eval's result)."""
    if m.kind == "mrr":
        return "recip_rank", "recip_rank"
    name = _TREC_NAME[m.kind]
    return f"{name}.{m.cutoff}", f"{name}_{m.cutoff}"


def _value(m: Measure, trec_values: Mapping[str, float]) -> float:
    """One measure of one topic from pytrec_eval's values, applying the MRR cutoff (trec_eval -M k)."""
    value = trec_values[_trec_measure(m)[1]]
    if m.kind == "mrr" and m.cutoff is not None and (value == 0.0 or round(1.0 / value) > m.cutoff):
        return 0.0
    return value


def evaluate(
    run: Mapping[str, Mapping[str, float]] | Mapping[str, Sequence[tuple[str, float]]],
    qrels: Mapping[str, Mapping[str, int]],
    measures: Sequence[str] = DEFAULT_MEASURES,
    complete: bool = False,
) -> EvalResult:
    """Evaluates `run` against `qrels` with trec_eval (see the module docstring).

    run: {qid: {docid: score}} (as `trec.read_run` returns) or {qid: [(docid, score), ...]}; any number of hits.
    qrels: {qid: {docid: rel}} (as `trec.read_qrels` returns). complete: trec_eval -c.
    Raises CfirError for an unknown measure, a NaN score, or when no topic is in both run and qrels.
    """
    if isinstance(measures, str):
        measures = (measures,)
    parsed = [parse_measure(m) for m in measures]
    if len({m.name for m in parsed}) != len(parsed):
        raise CfirError(f"measures {list(measures)} name one measure twice")
    judged = {q: {d: int(r) for d, r in j.items()} for q, j in qrels.items() if j}
    scored = {q: _topic_scores(q, hits) for q, hits in run.items() if q in judged and hits}
    if not scored:
        raise CfirError(
            f"no topic is in both the run ({len(run)} topics) and the qrels ({len(qrels)} topics); "
            "check that the run and qrels are for the same split and use the same ids"
        )
    evaluator = pytrec_eval.RelevanceEvaluator(judged, {_trec_measure(m)[0] for m in parsed})
    raw = evaluator.evaluate(scored)
    per_query: dict[str, dict[str, float]] = {}
    # trec_eval walks the qrels topics in strcmp order; keep that order so the means match to the last bit.
    for qid in sorted(judged):
        if qid in raw:
            per_query[qid] = {m.name: _value(m, raw[qid]) for m in parsed}
        elif complete:
            per_query[qid] = {m.name: 0.0 for m in parsed}
    aggregate = {}
    for m in parsed:
        total = 0.0
        for values in per_query.values():
            total += values[m.name]
        aggregate[m.name] = total / len(per_query)
    return EvalResult(per_query, aggregate, tuple(m.name for m in parsed), len(per_query), complete)
