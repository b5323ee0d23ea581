"""The entities of a collection in several languages: each document's by the NER of its language
(`index.languages`, `cfir_jax.core.languages`).

A language gets the spaCy pipeline its table entry names (English: `index.entities.spacy_model`, exactly as before
languages existed). A language with none, and one whose pipeline is not installed, gets the fallback rule
(`index.languages.fallback_ner`): the runs of capitalised words (`cfir_jax.nlp.capitalised`) or the English pipeline.
Each language's rule is recorded by the store (`languages` in its manifest, and the documents each read with
`language_documents`) and printed by index.py's closing table and `--compare`, so a reader always knows which
documents were read how. A collection all in English uses the plain extractor and records nothing more.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from cfir_jax.core.errors import CfirError
from cfir_jax.core.languages import REFERENCE, Setup, setup_of
from cfir_jax.nlp.capitalised import CapitalisedNames
from cfir_jax.nlp.entities import EntityExtractor, load_spacy, spacy_model_name
from cfir_jax.nlp.entity_sources import SourcedExtractor
from cfir_jax.nlp.entity_workers import EntityWorkers, Settings

log = logging.getLogger(__name__)


def index_workers(config, spacy_model: str | None, labels, documents: int) -> EntityWorkers | None:
    """The worker processes index.py's entity stage parses `documents` documents of a pipeline with
    (`Settings.of(config, "index", documents)`; loading while the stage reads its corpus), or None when fewer than
    2: this process parses."""
    settings = Settings.of(config, "index", documents)
    return EntityWorkers(spacy_model, labels, settings, wait=False) if settings.workers > 1 else None


def language_ner(config, setup: Setup, loaded: dict, pooled: int) -> tuple[Any, str]:
    """(the NER of one language, its rule as the tables say it). `loaded`: the spaCy pipelines loaded so far by name
    (a pipeline several languages fall back to loads once); `pooled`: in index.py's entity stage, the documents this
    pipeline parses there, over entity_workers.index processes (0: a query's parse, in the calling thread)."""
    e = config.index.entities
    if setup.ner is not None:
        try:
            if setup.ner not in loaded:
                loaded[setup.ner] = load_spacy(setup.ner or None)
        except CfirError:
            if setup.code == REFERENCE:
                raise
            log.warning("%s: spaCy pipeline %s is not installed; its documents get the fallback rule (see "
                        "docs/languages.md)", setup.code, setup.ner)
            return CapitalisedNames(), f"{setup.ner} not installed: capitalised n-grams"
        nlp = loaded[setup.ner]
        workers = index_workers(config, setup.ner, setup.labels, pooled) if pooled else None
        extractor = EntityExtractor(nlp, setup.labels, e.batch_size, workers=workers)
        own = "" if not setup.fallback else "no pipeline: "
        return extractor, f"{own}spaCy {spacy_model_name(nlp)}"
    return CapitalisedNames(), "no pipeline: capitalised n-grams"


class LanguageEntities:
    """The entity store's extractor for a collection in several languages: an item is a document's language and the
    item of its language's `SourcedExtractor`; `extract` runs each language's over its documents and keeps their
    order. `settings` (what a chunk and the store are computed with) are the English extractor's and each
    language's rule; `counts`: the documents of each language (recorded, not compared)."""

    def __init__(self, reference: SourcedExtractor, by_language: Mapping[str, SourcedExtractor],
                 rules: Mapping[str, str], counts: Mapping[str, int]):
        self.extractor, self.sources = reference.extractor, reference.sources  # as SourcedExtractor's
        self.reference, self.by_language = reference, dict(by_language)
        self.rules, self.counts = dict(sorted(rules.items())), dict(sorted(counts.items()))

    @classmethod
    def of(cls, config, reference: SourcedExtractor, counts: Mapping[str, int]) -> LanguageEntities:
        """The extractors of every language `counts` holds (documents per language), English's `reference`."""
        loaded: dict[str, Any] = {}
        by_language, rules = {}, {}
        for code in sorted(counts):
            if code == REFERENCE:
                ner, rule = reference.extractor, f"spaCy {reference.settings['spacy_model']}"
            else:
                ner, rule = language_ner(config, setup_of(config, code), loaded, pooled=counts[code])
            by_language[code], rules[code] = SourcedExtractor(ner, reference.sources), rule
        return cls(reference, by_language, rules, counts)

    @property
    def settings(self) -> dict[str, Any]:
        labels = {c: list(x.extractor.labels) for c, x in self.by_language.items() if hasattr(x.extractor, "labels")}
        return {**self.reference.settings, "languages": self.rules, "language_labels": dict(sorted(labels.items()))}

    @property
    def manifest_fields(self) -> dict[str, Any]:
        """What the store records beside its settings: the documents each language's rule read."""
        return {"language_documents": self.counts}

    def item(self, text: str, categories, lang: str = REFERENCE) -> str:
        """What the store streams for a document of `text` (and `categories`) in `lang`."""
        return json.dumps([lang, self.by_language[lang].item(text, categories)], ensure_ascii=False)

    def extract(self, items: Iterable[str]) -> Iterator[list[str]]:
        """Per item, its entities by its language's extractor, in the items' order."""
        pairs = [json.loads(item) for item in items]
        out: list[list[str] | None] = [None] * len(pairs)
        for code in dict.fromkeys(lang for lang, _ in pairs):
            rows = [i for i, (lang, _) in enumerate(pairs) if lang == code]
            if code not in self.by_language:
                raise CfirError(f"entities: a document in {code!r}, a language this extractor was not made for; "
                                "rebuild W/entities with index.py")
            for i, found in zip(rows, self.by_language[code].extract(pairs[i][1] for i in rows)):
                out[i] = found
        return iter(out)
