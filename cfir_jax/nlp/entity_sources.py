"""Where a document's entities come from (`index.entities.sources`): spaCy's named entities of its text (the
paper's), those plus the category names of its section (what the paper's Figure 7 shows), or the category names
alone.

AToMiC's sections carry a `category` field, the Wikipedia category names of the page ("Annual events in New York
City", "Searchlights"); the synthetic world gives each document a few (`cfir_jax.data.synthetic`). A category name
is an entity like any other: normalised and de-duplicated with the spaCy entities by `entity_key`, encoded by the
frozen text tower at the entity length, indexed from the training documents and looked up at query time. A free
text query has no categories: its entities are spaCy's whatever the setting.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from cfir_jax.core.errors import CfirError
from cfir_jax.nlp.entities import EntityExtractor, entity_key, normalize_entity

SOURCES = ("spacy", "spacy+categories", "categories")
# The document metadata field the category names are read from (AToMiC's and the synthetic world's).
CATEGORY_FIELD = "category"


def check_sources(sources: str) -> str:
    """`sources` if it is one of SOURCES, else one error line."""
    if sources not in SOURCES:
        raise CfirError(f"index.entities.sources={sources!r}: use one of {', '.join(SOURCES)}")
    return sources


def categories_of(doc) -> tuple[str, ...]:
    """The category names of a corpus Document (empty when it has none)."""
    return tuple(doc.metadata.get(CATEGORY_FIELD, ()))


def merged(spacy_entities: Sequence[str], categories: Iterable[str]) -> list[str]:
    """spaCy's entities then the category names, normalised as entities and unique by `entity_key` (first wins)."""
    seen: dict[str, str] = {}
    for name in (*spacy_entities, *(normalize_entity(c) for c in categories)):
        if name:
            seen.setdefault(entity_key(name), name)
    return list(seen.values())


class SourcedExtractor:
    """The entity store's extractor: spaCy's entities of a document's text, its category names, or both.

    The store streams one string per document (`item`): the text itself under "spacy", else the text and the
    category names as a JSON pair. `settings` is the spaCy extractor's, plus `sources` when it is not plain spaCy
    (so a store built before the choice existed, whose manifest has no such field, is the "spacy" store it was)."""

    def __init__(self, extractor: EntityExtractor, sources: str):
        self.extractor, self.sources = extractor, check_sources(sources)

    @property
    def settings(self) -> dict[str, Any]:
        extra = {} if self.sources == "spacy" else {"sources": self.sources}
        return {**self.extractor.settings, **extra}

    def item(self, text: str, categories: Sequence[str]) -> str:
        """What the store streams for a document of `text` in `categories`."""
        return text if self.sources == "spacy" else json.dumps([text, list(categories)], ensure_ascii=False)

    def extract(self, items: Iterable[str]) -> Iterator[list[str]]:
        """Per `item`, its entities in order: spaCy's first, then the category names (unique by entity_key)."""
        if self.sources == "spacy":
            return self.extractor.extract(items)
        pairs = [json.loads(item) for item in items]
        if self.sources == "categories":
            return iter([merged((), cats) for _, cats in pairs])
        found = self.extractor.extract(text for text, _ in pairs)
        return (merged(ents, cats) for ents, (_, cats) in zip(found, pairs))


def manifest_sources(manifest: dict) -> str:
    """The sources an entity store was built from (stores of before the choice: 'spacy')."""
    return manifest.get("sources") or "spacy"
