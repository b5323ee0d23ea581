"""The retrieve command (`retrieve.py --query doc.txt` / `--queries docs.jsonl`): retrieve for documents given as
files and show the hits, through the library's `Index` (`cfir_jax.api.index`, the one query core: it reads and
checks the file, retrieves and makes the records; `--format json` is their JSON).

Shown on stdout as a table, JSON lines or TREC lines (`shown` hits each); optionally an HTML page with the images,
a TREC run file (`top` hits each) and its measures against a qrels file (`cfir_jax.eval.runs`; evaluated with exact
SR, like --evaluate, with the unknown entities and SR's agreement stated).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

import ml_collections

from cfir_jax.api.index import Index
from cfir_jax.core.query_rule import Condition
from cfir_jax.eval import runs
from cfir_jax.retrieve import report
from cfir_jax.retrieve.methods import METHODS


@dataclasses.dataclass(frozen=True)
class Asked:
    """The documents a run asks for, and how: the document in the file `query` or the JSON lines of `queries`, in
    `lang` where they state none (None: found); only images passing the conditions `where` (parsed from --where by
    `commands.flags`; docs/filters.md) are ranked; near-duplicates are folded under their best-ranked one when `fold`
    (None: when the hits are only shown, not written to a run file nor scored, so the measures count every
    image); `facets`: the fields counted over what each query ranked (docs/filters.md)."""

    query: str = ""
    queries: str = ""
    lang: str | None = None
    where: Sequence[Condition] | None = None
    fold: bool | None = None
    facets: Sequence[str] | None = None


@dataclasses.dataclass(frozen=True)
class Shown:
    """What stdout shows of each answer: `shown` hits in `fmt` (a table, JSON lines or TREC lines tagged `tag`), and
    the HTML page `html` of them when asked."""

    fmt: str = "table"
    shown: int = 20
    html: str = ""
    tag: str = "cfir"


@dataclasses.dataclass(frozen=True)
class RunFile:
    """The run written to `output` (`top` hits a document, tagged as shown) and scored against `qrels` by
    `measures`, when asked."""

    output: str = ""
    qrels: str = ""
    top: int = 1000
    measures: str = "trec_eval"


def run(config: ml_collections.ConfigDict, workdir, method: str, asked: Asked, display: Shown = Shown(),
        run_file: RunFile = RunFile()) -> None:
    """Retrieves what was `asked` by `method` and prints / writes it: the hits as `display` says, the run file."""
    query, queries, lang, where, fold = asked.query, asked.queries, asked.lang, asked.where, asked.fold
    facets = asked.facets
    fmt, html, tag, shown = display.fmt, display.html, display.tag, display.shown
    output, qrels, top, measures = run_file.output, run_file.qrels, run_file.top, run_file.measures
    fold = not (output or qrels) if fold is None else fold
    index = Index(config, workdir, method, evaluation=bool(qrels))  # the library's (cfir_jax.open's)
    kept = top if output or qrels else shown  # a run file keeps `top` hits; captions are read for the shown ones
    results = index.search_file(query or queries, jsonl=not query, top_k=kept, described=shown, lang=lang,
                                where=where, fold=fold, facets=facets)
    sys.stderr.write("".join(f"note: {note}\n" for note in index.notes))  # what the retriever decided
    page = "".join(report.html_page(r, index.image_bytes, shown) for r in results) if html else ""
    said = []  # what a scored run's lines add after its measures
    if qrels and METHODS[method].uses_entities:
        said.append(report.unknown_summary(results, config.retrieval.unknown_entities))
    if qrels:
        said.append(report.sr_line([index.scored_by], [results]))
    for result in results:
        print(report.shown(result, fmt, shown, tag))
    if html:
        Path(html).write_text(page, encoding="utf-8")
        print(f"wrote {html}", file=sys.stderr)
    runs.write_and_score(runs.run_of(results), output, qrels, tag, top, measures, after=said)
