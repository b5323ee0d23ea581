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

from cfir_jax.core.errors import CfirError

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
    # Judged topics the run has no hit for (scored 0 under complete, left out of the mean otherwise).
    no_hits: int = 0

    def table(self, per_query: bool = False) -> str:
        """trec_eval-style text: `measure  qid  value` lines, the aggregate under qid `all` (after topics if asked)."""
        width = max(len(m) for m in (*self.measures, "num_q"))
        rows = []
        if per_query:
            for qid, values in self.per_query.items():
                rows += [f"{m:<{width}}\t{qid}\t{values[m]:.4f}" for m in self.measures]
        rows.append(f"{'num_q':<{width}}\tall\t{self.num_queries}")
        rows.append(f"{'no_hits':<{width}}\tall\t{self.no_hits}")
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
    return EvalResult(per_query, aggregate, tuple(m.name for m in parsed), len(per_query), complete,
                      no_hits=len(judged) - len(raw))


# ------------------------------------------------------------------------------------------ the authors' metric

# What retrieve.py --measures (retrieval.measures) accepts: 'trec_eval' is trec_eval -c (every qrels topic counts,
# one without hits scores 0); 'trec_eval_no_c' the mean over the topics with hits only (trec_eval without -c, what
# --evaluate printed before issue 29); 'authors' the authors' code's metric; 'both' trec_eval -c and the authors'.


def complete_for(measures: str) -> bool:
    """Whether the trec_eval figures of `measures` (a MEASURE_SETS name) are trec_eval -c's."""
    return measures != "trec_eval_no_c"
# The authors' evaluation (GLA-IR/CFIR atomic/atomic_engine.py, Atomicstage2Handler.after_eval) scores queries in
# chunks of 1,000.
AUTHORS_CHUNK = 1000


def qrels_rows(qrels: Mapping[str, Mapping[str, int]]) -> list[tuple[str, str]]:
    """The relevant (qid, docid) pairs of `qrels`, one per qrels line, in the qrels' own order."""
    return [(qid, docid) for qid, judged in qrels.items() for docid, rel in judged.items() if int(rel) >= 1]


def authors_measures(
    run: Mapping[str, Mapping[str, float]] | Mapping[str, Sequence[tuple[str, float]]],
    qrels: Mapping[str, Mapping[str, int]],
    chunk: int = AUTHORS_CHUNK,
) -> dict[str, float]:
    """MRR@10, R@10 and R@1000 as the authors' code computes them, which trec_eval does not:

      * one query per relevant qrels line (a text with two relevant images is two queries, and each query's only
        relevant image is its own line's: the other one ranked above it does not count); the query's ranking is
        its text's run;
      * R@k of a query is 1 when its image is in the top k (a hit rate), MRR@10 the reciprocal of that image's
        rank within the top 10;
      * the mean is taken per chunk of `chunk` queries in qrels order, and the chunk means are summed and divided
        by len // chunk + 1 (one chunk too many when the count is a multiple of the chunk; a short last chunk
        weighs as much as a full one);
      * their stage-2 MRR (`mrr@10`) compares the rankings of chunk c with the images of the *first* chunk's
        queries (the loop variable that should add the chunk offset is reused); `mrr@10_offset` is the same
        measure with the offset, as their stage-1 evaluation computes it. R@k keeps the offset in both.

    Returns {"mrr@10", "mrr@10_offset", "recall@10", "recall@1000", "num_rows"}. Ranking is by score, descending;
    equal scores keep the run's order.
    """
    if chunk < 1:
        raise CfirError(f"authors' metric: chunk must be >= 1, got {chunk}")
    rows = qrels_rows(qrels)
    if not rows:
        raise CfirError("authors' metric: the qrels have no relevant line")
    ranked: dict[str, list[str]] = {}
    for qid in {q for q, _ in rows}:
        hits = run.get(qid) or {}
        pairs = list(hits.items()) if isinstance(hits, Mapping) else [tuple(h) for h in hits]
        ranked[qid] = [d for d, _ in sorted(pairs, key=lambda p: -float(p[1]))[:1000]]

    def reciprocal(ranking: list[str], target: str) -> float:
        top = ranking[:10]
        return 1.0 / (top.index(target) + 1) if target in top else 0.0

    sums = dict.fromkeys(("mrr@10", "mrr@10_offset", "recall@10", "recall@1000"), 0.0)
    for start in range(0, len(rows), chunk):
        part = rows[start:start + chunk]
        values = dict.fromkeys(sums, 0.0)
        for j, (qid, docid) in enumerate(part):
            ranking = ranked[qid]
            values["mrr@10"] += reciprocal(ranking, rows[j][1])  # the first chunk's image: no offset
            values["mrr@10_offset"] += reciprocal(ranking, docid)
            values["recall@10"] += float(docid in ranking[:10])
            values["recall@1000"] += float(docid in ranking[:1000])
        for name in sums:
            sums[name] += values[name] / len(part)
    total = len(rows) // chunk + 1
    return {**{name: value / total for name, value in sums.items()}, "num_rows": float(len(rows))}


def authors_table(rows: Sequence[tuple[str, Mapping[str, float]]]) -> str:
    """The authors' figures of each (label, authors_measures) row, under a heading that says what they are."""
    width = max(len("row"), *(len(label) for label, _ in rows))
    lines = ["the authors' metric (one query per qrels line, chunk means; not comparable with trec_eval's rows)",
             f"{'row':<{width}}  MRR@10  MRR@10 with offset  R@10    R@1000  qrels lines"]
    for label, m in rows:
        lines.append(f"{label:<{width}}  {m['mrr@10']:.4f}  {m['mrr@10_offset']:<18.4f}  {m['recall@10']:.4f}  "
                     f"{m['recall@1000']:.4f}  {int(m['num_rows']):,}")
    return "\n".join(lines)
