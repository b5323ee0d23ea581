"""`retrieve.py --evaluate SPLIT [--compare]`: retrieval for the corpus' own topics, scored like trec_eval.

Each row (`cfir_jax.eval.comparison`: the paper's Table 3 and the rows beyond, or the one configured method) is its
own Retriever over its row's config; evaluation scores unions exactly (`retrieval.eval_sr`, "exact" unless asked
otherwise) and, with "fast", states its measured agreement with exact scoring. Prints the table, how SR scored, the
third stage's cost and the unknown entities; optionally writes the recall@k curves and (one row) the run file.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

import ml_collections

from cfir_jax.api.index import Index
from cfir_jax.eval import languages, metrics, plots, runs
from cfir_jax.eval.comparison import Row, comparison_rows, full_row_note, k_rows, single_row
from cfir_jax.eval.train_time import train_time
from cfir_jax.retrieve import report
from cfir_jax.retrieve.filters import Filter
from cfir_jax.retrieve.results import Result
from cfir_jax.stores.entity_index import EntityIndex
from cfir_jax.stores.layout import Layout


@dataclasses.dataclass(frozen=True)
class Topics:
    """The queries an evaluation asks: the topics of the qrels `split`, each ranking only the images that pass
    `where` (docs/filters.md), with `fold` near-duplicates folded before scoring (off by default: the paper's
    measures count every image; docs/duplicates.md)."""

    split: str
    where: list[str] | None = None
    fold: bool = False


@dataclasses.dataclass(frozen=True)
class Reporting:
    """What an evaluation prints and writes: its `measures` (trec_eval -c's, the authors' or both), the recall@k
    curves to `plot`, and (one row) the run file `output`, its lines tagged `tag` and cut to `top` hits a topic."""

    measures: str = "trec_eval"
    plot: str = ""
    output: str = ""
    tag: str = "cfir"
    top: int = 1000


def run(config: ml_collections.ConfigDict, workdir, topics: Topics, method: str = "cfir", *, compare: bool = False,
        compare_k: Sequence[int] = (), reporting: Reporting = Reporting()) -> list[report.EvalRow]:
    """The evaluate command (`retrieve.py --evaluate SPLIT`): the configured `method` alone, the paper's Table 3
    (`compare`) or full CFIR at each K of `compare_k` (Table 4), over the `topics`; prints the table."""
    if compare_k:
        rows = check_k_rows(workdir, k_rows(compare_k, method))
    else:
        rows = comparison_rows(config, workdir) if compare else (single_row(method),)
        if compare and (note := full_row_note(workdir)):
            print(f"note: {note}", file=sys.stderr)
    return evaluate(config, workdir, topics, rows, reporting)


def check_k_rows(workdir, rows: Sequence[Row]) -> Sequence[Row]:
    """The Table 4 rows, after refusing (one line, before any retrieval) a K above the one the index was built with."""
    index = EntityIndex.open(Layout.of(workdir).entity_index)
    for row in rows:
        index.with_k(row.overrides.get("retrieval.k", 0))
    return rows


def train_time_of(index: Index) -> str:
    """Training time per epoch of the model that scored the row's queries, with its hardware (from the run's timing
    log); '-' for the frozen index encoder, 'not logged' for a run trained before the log existed."""
    run = index.trained_by()
    if run is None:
        return "-"
    t = train_time(run)
    return t.label() if t is not None else "not logged"


def _filtered(where: list[str], first: Result) -> str:
    """The topics line's filter part: how many images pass `where` (every topic's filter is the same)."""
    if first.passed is None:
        return ""
    return f", filtered by {Filter(where)}: {first.passed:,} of {first.live:,} images pass"


def evaluate(config: ml_collections.ConfigDict, workdir, topics: Topics, rows: Sequence[Row],
             reporting: Reporting = Reporting()) -> list[report.EvalRow]:
    """Runs every row over the `topics` and prints the evaluation table (trec_eval -c's unless `reporting.measures`
    says otherwise, the authors' metric or both), how ER and SR searched, and the unseen query entities with what
    each row's rule did with them; returns its rows."""
    split, where, fold = topics.split, topics.where, topics.fold
    plot, output, tag, top, measures = (reporting.plot, reporting.output, reporting.tag, reporting.top,
                                        reporting.measures)
    table, all_results, curves, authors, rules, scorers, per_query = [], [], {}, [], {}, [], []
    er_line = ""
    complete = metrics.complete_for(measures)
    for row in rows:
        row_config = row.config(config)
        index = Index(row_config, workdir, row.method, evaluation=True)  # retrieval.eval_sr, agreement measured
        sys.stderr.write("".join(f"note: {note}\n" for note in index.notes))  # what the retriever decided
        docs = index.corpus_documents(split)
        results = index.retrieve(docs, progress=True, where=where, fold=fold)  # every hit, no caption read
        rule = row_config.retrieval.unknown_entities if index.reads_entities() else "-"
        if rule != "-":  # the same entities for every row: one count per rule, with the rows that used it
            rules.setdefault(rule, (results, []))[1].append(row.label)
        all_results.append(results)
        scorers.append(index.scored_by)  # what scored the row (its words), not the row's stores
        run = runs.run_of(results)
        qrels = index.qrels(split)
        if plot:
            curves[row.label] = plots.recall_curve(run, qrels)
        res = metrics.evaluate(run, qrels, measures=report.EVAL_MEASURES, complete=complete)
        per_query.append((row.label, res.per_query))
        table.append(report.EvalRow(row.label, res.aggregate, results, index.model_used, train_time_of(index),
                                    unknown_rule=rule, no_hits=res.no_hits))
        if measures not in ("trec_eval", "trec_eval_no_c"):
            authors.append((row.label, metrics.authors_measures(run, qrels)))
        if not er_line:  # the entity index as built (a row may cut it)
            er_line = index.entity_index_note()
        if len(rows) == 1:
            runs.write_and_score(run, output, "", tag, top)
    print(f"{split} split, {len(docs)} topics" + (_filtered(where, all_results[0][0]) if where and docs else ""))
    if measures != "authors":
        print(report.eval_table(table))
        print(report.mean_line(complete))
    if authors:
        print(metrics.authors_table(authors))
    unknown_line = report.unknown_rules_line(rules) if rules else ""
    langs = index.topic_languages([d.doc_id for d in docs])
    for line in (er_line, report.sr_line(scorers, all_results), report.rerank_line(table),
                 report.lexical_line(table), unknown_line, *languages.rules_lines(Layout.of(workdir), langs),
                 languages.language_table(per_query, langs, report.EVAL_MEASURES)):
        if line:  # how ER and SR searched, the third stage's cost, the unseen entities, the languages: when any
            print(line)
    if plot:
        plots.plot_recall_curves(curves, plot, f"{split} split, {len(docs)} topics")
        print(f"wrote {plot}", file=sys.stderr)
    return table
