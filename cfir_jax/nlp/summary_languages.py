"""The summaries of a collection in several languages: each document's by the summarizer of its language
(`index.languages`, `cfir_jax.core.languages`).

English keeps `index.summaries.summarizer` (BART-large-CNN, the paper's; the demo's extractive one). No abstractive
model for another language is packaged here (BART-large-CNN writes English whatever it reads), so a language gets
the extractive lead summary (its leading sentences within `index.summaries.extractive_tokens` words, sentences of
any script), the stated fallback, unless its table entry names a BART model of its own (`summarizer="bart"`,
`bart_model=...`). Each language's rule is recorded by the summary store and printed by index.py's closing table.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from cfir_jax.core.errors import CfirError
from cfir_jax.core.languages import REFERENCE, setup_of
from cfir_jax.nlp.summarizer import Summarizer, make_summarizer


def rule_of(config, code: str) -> str:
    """How language `code` is summarised, as the store records it and the tables say it (nothing is loaded)."""
    if code == REFERENCE:
        return config.index.summaries.summarizer
    setup = setup_of(config, code)
    if setup.summarizer == "extractive":
        return f"extractive lead, {config.index.summaries.extractive_tokens} words (no abstractive model)"
    return f"bart {setup.bart_model}"


def rules_of(config, counts: Mapping[str, int]) -> dict[str, str] | None:
    """Each language's rule, for a collection not all in English (None for one that is: it records none)."""
    return {code: rule_of(config, code) for code in sorted(counts)} if set(counts) - {REFERENCE} else None


class LanguageSummaries:
    """The summary store's summarizer for a collection in several languages: an item is a document's language and
    its summary input; `summarize` runs each language's summarizer over its documents and keeps their order.
    `settings` are English's and each language's rule; `counts`: the documents of each language."""

    def __init__(self, reference: Summarizer, by_language: Mapping[str, Summarizer], rules: Mapping[str, str],
                 counts: Mapping[str, int]):
        self.name, self.reference = reference.name, reference
        self.by_language, self.rules, self.counts = dict(by_language), dict(sorted(rules.items())), \
            dict(sorted(counts.items()))

    @classmethod
    def of(cls, config, reference: Summarizer, counts: Mapping[str, int]) -> LanguageSummaries:
        by_language = {}
        for code in sorted(counts):
            setup = setup_of(config, code)
            by_language[code] = reference if code == REFERENCE else \
                make_summarizer(config, setup.summarizer, setup.bart_model, any_script=True)
        return cls(reference, by_language, rules_of(config, counts) or {}, counts)

    @property
    def settings(self) -> dict[str, Any]:
        return {**self.reference.settings, "languages": self.rules}

    @property
    def manifest_fields(self) -> dict[str, Any]:
        return {"language_documents": self.counts}

    @staticmethod
    def item(text: str, lang: str) -> str:
        return json.dumps([lang, text], ensure_ascii=False)

    def summarize(self, items: list[str]) -> list[str]:
        pairs = [json.loads(item) for item in items]
        out = [""] * len(pairs)
        for code in dict.fromkeys(lang for lang, _ in pairs):
            rows = [i for i, (lang, _) in enumerate(pairs) if lang == code]
            if code not in self.by_language:
                raise CfirError(f"summaries: a document in {code!r}, a language this summarizer was not made for; "
                                "rebuild W/summaries with index.py")
            for i, summary in zip(rows, self.by_language[code].summarize([pairs[i][1] for i in rows])):
                out[i] = summary
        return out
