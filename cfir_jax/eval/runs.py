"""Run files and their scores: a TREC run made of a search's results (`run_of`), written (`trec.write_run`) and
measured against a qrels file (trec_eval's, the authors' or both). The commands call it (`retrieve.py --queries
--output --qrels`, `--evaluate`); no command module shares another's code for it."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence

from cfir_jax.eval import trec


def run_of(results: Iterable) -> dict[str, list[tuple[str, float]]]:
    """A TREC run {query id: [(image id, score), ...]}: the one maker of a run, of the library's records
    (`cfir_jax.retrieve.results.Result`: its `id`, each hit's `id` and `score`), which every door and evaluation
    read alike; named by their fields, not imported: eval stands below retrieval."""
    return {r.id: [(h.id, h.score) for h in r.hits] for r in results}


def write_and_score(run: dict, output: str, qrels: str, tag: str, top: int, measures: str = "trec_eval",
                    after: Sequence[str] = ()) -> None:
    """Writes the run file (output) and prints its measures against a qrels file (qrels), each when given: trec_eval's
    (-c over the queried topics the qrels judge, unless `measures` is 'trec_eval_no_c'), the authors' or both; then
    the lines `after` (what the caller says of the scored run: its unknown entities, how SR scored)."""
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
        for line in after:
            print(line)


def no_hits_line(res) -> str:
    """What became of the judged topics without a hit: scored 0 (trec_eval -c) or left out of the mean."""
    if res.complete:
        return f"topics without hits: {res.no_hits:,} of {res.num_queries:,}, each scored 0 (trec_eval -c)"
    return (f"topics without hits: {res.no_hits:,}, left out of the mean over {res.num_queries:,} topics with hits "
            "(trec_eval without -c: --measures trec_eval_no_c)")
