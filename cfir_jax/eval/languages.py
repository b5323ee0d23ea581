"""The evaluation of a collection in several languages, per language (`retrieve.py --evaluate SPLIT [--compare]`):
how many topics each language has and the rule each was read with (its NER, its summarizer: the stores' manifests
record them), and every row's figures over each language's topics. The means are over the same per-topic values as
the main table's (trec_eval's, with -c unless `--measures trec_eval_no_c`), so a language's figure is the main one
restricted to its topics. A collection all in English prints nothing more: its table is the one it always was.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import numpy as np

from cfir_jax.core.errors import CfirError
from cfir_jax.core.languages import REFERENCE
from cfir_jax.stores.contract import read_manifest

PerQuery = Mapping[str, Mapping[str, float]]  # topic -> measure -> value (metrics.EvalResult.per_query)


def topic_languages(corpus, topics) -> dict[str, str]:
    """Each topic's (document id's) language; English for a corpus that recorded none."""
    if not corpus.doc_langs:
        return {t: REFERENCE for t in topics}
    row = {d: i for i, d in enumerate(corpus.doc_ids)}
    return {t: corpus.doc_langs[row[t]] if t in row else REFERENCE for t in topics}


def _rules(layout, kind: str) -> dict[str, str]:
    """Each language's rule a store recorded ({} for an English store, or none)."""
    try:
        return dict(read_manifest(getattr(layout, kind), kind).get("languages") or {})
    except CfirError:  # no such store (a workdir that needs none): nothing to say
        return {}


def rules_lines(layout, langs: Mapping[str, str]) -> list[str]:
    """The topics per language, with the rules their entities and summaries were made by, and the topics per NER
    rule; [] when every topic is English."""
    counts = Counter(langs.values())
    if set(counts) <= {REFERENCE}:
        return []
    ner, summary = _rules(layout, "entities"), _rules(layout, "summaries")
    parts = [f"{code} {n:,} (NER: {ner.get(code, '-')}; summary: {summary.get(code, '-')})"
             for code, n in sorted(counts.items())]
    by_rule = Counter()
    for code, n in counts.items():
        by_rule[ner.get(code, "-")] += n
    return [f"topics per language: {'; '.join(parts)}",
            "topics per NER rule: " + "; ".join(f"{rule} {n:,}" for rule, n in sorted(by_rule.items()))]


def language_table(rows: Sequence[tuple[str, PerQuery]], langs: Mapping[str, str], measures: Sequence[str]) -> str:
    """Each row's means over each language's topics (those of its per-query values); '' when every topic is
    English."""
    codes = sorted(set(langs.values()))
    if set(codes) <= {REFERENCE}:
        return ""
    head = ["row", "language", "topics", *(_short(m) for m in measures)]
    table = [head]
    for label, per_query in rows:
        for code in codes:
            values = [v for q, v in per_query.items() if langs.get(q) == code]
            if values:
                table.append([label, code, f"{len(values):,}",
                              *(f"{np.mean([v[m] for v in values]):.4f}" for m in measures)])
    widths = [max(len(t[i]) for t in table) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(t, widths)).rstrip() for t in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "per language:\n" + "\n".join(lines)


def _short(measure: str) -> str:
    """A column's name as the main table prints it (mrr@10 -> MRR@10, recall@10 -> R@10, success@1000 -> S@1000)."""
    kind, _, k = measure.partition("@")
    return {"mrr": "MRR", "recall": "R", "success": "S"}.get(kind, kind) + (f"@{k}" if k else "")
