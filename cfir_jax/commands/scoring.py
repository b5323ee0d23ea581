"""What the query and evaluation commands share: the exact SR of evaluation, the Retriever's notes, and the run file
with its measures against qrels (trec_eval's, the authors' or both). Apart from `evaluate` so that a query run
(`retrieve.py --query`) loads none of the evaluation's tables."""

from __future__ import annotations

import sys

import ml_collections

from cfir_jax.eval import trec
from cfir_jax.retrieve.pipeline import Retriever


def evaluation_sr(config: ml_collections.ConfigDict) -> None:
    """Evaluation scores with retrieval.eval_sr (exact unless asked otherwise), whatever retrieval.sr says."""
    config.retrieval.sr = config.retrieval.eval_sr


def print_notes(retriever: Retriever) -> None:
    for note in retriever.notes:
        print(f"note: {note}", file=sys.stderr)


def write_and_score(run: dict, output: str, qrels: str, tag: str, top: int, measures: str = "trec_eval") -> None:
    """Writes the run file (output) and prints its measures against a qrels file (qrels), each when given: trec_eval's
    (-c over the queried topics the qrels judge, unless `measures` is 'trec_eval_no_c'), the authors' or both."""
    if output:
        trec.write_run(output, run, tag=tag, max_hits=top)
        print(f"wrote {output}", file=sys.stderr)
    if qrels:
        # why: trec_eval's tables (pytrec_eval) load only when a run is scored, never for a query's hits
        from cfir_jax.eval import metrics

        # The topics asked about: a qrels file may judge more documents than the queries file holds.
        judged = {q: j for q, j in trec.read_qrels(qrels).items() if q in run}
        if measures != "authors":
            res = metrics.evaluate(run, judged, complete=metrics.complete_for(measures))
            print(res.table())
            print(no_hits_line(res))
        if measures not in ("trec_eval", "trec_eval_no_c"):
            print(metrics.authors_table([(tag, metrics.authors_measures(run, judged))]))


def no_hits_line(res) -> str:
    """What became of the judged topics without a hit: scored 0 (trec_eval -c) or left out of the mean."""
    if res.complete:
        return f"topics without hits: {res.no_hits:,} of {res.num_queries:,}, each scored 0 (trec_eval -c)"
    return (f"topics without hits: {res.no_hits:,}, left out of the mean over {res.num_queries:,} topics with hits "
            "(trec_eval without -c: --measures trec_eval_no_c)")
