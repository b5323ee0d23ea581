"""The retrieve command (`retrieve.py --query doc.txt` / `--queries docs.jsonl`): retrieve for documents given as
files and show the hits, through the library's `Index` (`cfir_jax.api.index`; `--format json` is its records' JSON).

Shown on stdout as a table, JSON lines or TREC lines (`shown` hits each); optionally an HTML page with the images,
a TREC run file (`top` hits each) and its measures against a qrels file (evaluated with exact SR, like --evaluate,
with the unknown entities and SR's agreement stated).
"""

from __future__ import annotations

import sys
from pathlib import Path

import ml_collections

from cfir_jax.api.index import Index
from cfir_jax.commands.scoring import evaluation_sr, print_notes, write_and_score
from cfir_jax.retrieve import report
from cfir_jax.retrieve.methods import METHODS
from cfir_jax.retrieve.pipeline import run_of
from cfir_jax.retrieve.queries import read_queries, read_query


def run(config: ml_collections.ConfigDict, workdir, method: str, *, query: str = "", queries: str = "",
           fmt: str = "table", shown: int = 20, top: int = 1000, html: str = "", output: str = "", qrels: str = "",
           tag: str = "cfir", measures: str = "trec_eval", where: list[str] | None = None) -> None:
    """Retrieves for the document in `query` or the documents of `queries` and prints / writes what was asked; only
    pictures passing the filters `where` (docs/filters.md) are ranked."""
    limit = int(config.serve.max_text_bytes)  # the one rule of a query's text, at every door
    docs = [read_query(query, limit)] if query else read_queries(queries, limit)
    if qrels:
        evaluation_sr(config)
    index = Index(config, workdir, method, measure_agreement=bool(qrels))  # the library's (cfir_jax.open's)
    retriever = index.retriever()
    print_notes(retriever)
    results = index.retrieve(docs, progress=len(docs) > 1, where=where)
    describe = retriever.describe_image
    for doc, result in zip(docs, results):
        if fmt == "table":
            print(report.table(result, describe, shown))
        elif fmt == "json":
            print(report.as_json(doc.doc_id, result, describe, shown))
        else:
            print(report.trec_lines(doc.doc_id, result, tag, shown))
    if html:
        row = {i: n for n, i in enumerate(retriever.corpus.image_ids)}
        image_bytes = lambda image_id: retriever.corpus.image(row[image_id]).image if image_id in row else b""  # noqa
        page = "".join(report.html_page(d.doc_id, r, describe, image_bytes, shown) for d, r in zip(docs, results))
        Path(html).write_text(page, encoding="utf-8")
        print(f"wrote {html}", file=sys.stderr)
    write_and_score(run_of(results, docs), output, qrels, tag, top, measures)
    if qrels:
        if METHODS[method].uses_entities:
            print(report.unknown_summary(results, config.retrieval.unknown_entities))
        print(report.sr_line([retriever.sr.scored_by()], [results]))
