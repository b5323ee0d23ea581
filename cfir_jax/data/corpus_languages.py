"""The languages of a corpus' rows as the corpus writer records them (`cfir_jax.data.corpus`: doc_langs.txt and
image_langs.txt beside the id lists, and the manifest's `languages`, only when some text is not English): each row's
language stated by the collection, else found by the detector the corpus stage passes
(`cfir_jax.nlp.language_detect`), else English."""

from __future__ import annotations

import collections
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Protocol

from cfir_jax.core.languages import REFERENCE
from cfir_jax.data.corpus import DOC_LANGS, IMAGE_LANGS


class Detect(Protocol):
    """What finds a text's language (`cfir_jax.nlp.language_detect.LanguageDetector`, which the corpus stage passes):
    a document's among every language, a caption's among its collection's documents' languages (`among`)."""

    settings: dict

    def document(self, text: str) -> str: ...

    def caption(self, text: str, among: Collection[str]) -> str: ...


def language_of(stated: str, text: str, detect: Callable[[str], str] | None) -> str:
    """The language of a row: stated, else detected from its text, else English; '' for a row without text."""
    if stated:
        return stated
    if not text.strip():
        return ""
    return detect(text) if detect is not None else REFERENCE


def write_languages(directory: Path, doc_langs: list[str], image_langs: list[str], detect: Detect | None = None
                    ) -> dict:
    """Writes the rows' languages beside the id lists (DOC_LANGS, IMAGE_LANGS) when any text is not English, and
    returns the manifest's `languages` field (counts per language of the documents and of the images with text, the
    detector's settings); an English corpus gets neither, and {} is returned."""
    if all(lang in (REFERENCE, "") for lang in (*doc_langs, *image_langs)):
        return {}
    (directory / DOC_LANGS).write_text("".join(f"{x}\n" for x in doc_langs), encoding="utf-8")
    (directory / IMAGE_LANGS).write_text("".join(f"{x}\n" for x in image_langs), encoding="utf-8")
    count = lambda langs: dict(sorted(collections.Counter(x for x in langs if x).items()))  # noqa: E731
    return {"languages": {"documents": count(doc_langs), "images": count(image_langs),
                          **dict(getattr(detect, "settings", {}))}}
