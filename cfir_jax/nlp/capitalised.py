"""The fallback NER of a language with no pipeline (`index.languages.fallback_ner="capitalised"`): runs of capitalised
words, the names a text writes as names.

A run is a sequence of words each starting with an upper-case letter (any script that has case), at most
`max_words` long, never crossing a sentence end or punctuation. A sentence's first word is capitalised whatever it
is, so a run that starts a sentence keeps its first word when the text also writes that word capitalised inside a
sentence, and otherwise only when the run is two words, the first never written in lower case and the second not a
name the text writes alone: a name of two words ("Mary Walker menulis" keeps "Mary Walker"; "Pada tahun 1850" drops
"Pada"; "Menurut Andrew Evans" drops "Menurut", a name of three words starting a sentence its first). Numbers are
not names (no DATE or CARDINAL). Each name is kept once, by `entity_key`, in order of first mention, as spaCy's
entities are. Scripts without case (Chinese, Japanese, Thai) find nothing: such a language needs a pipeline
(docs/languages.md).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

from cfir_jax.stores.entities import entity_key, normalize_entity

VERSION = 1
# A word: letters, digits, apostrophes and hyphens inside ("O'Brien", "Saint-Denis"); what separates runs: anything
# else but spaces between words.
_WORD = re.compile(r"\w+(?:['’-]\w+)*")
_SENTENCE_END = re.compile(r"[.!?…;:]\s*$|\n\s*\n\s*$")


def _capitalised(word: str) -> bool:
    return word[0].isupper() and not word[0].isdigit()


class CapitalisedNames:
    """`extract(texts)` as `EntityExtractor.extract`: per text, its runs of capitalised words."""

    def __init__(self, max_words: int = 5):
        self.max_words = int(max_words)

    @property
    def settings(self) -> dict[str, Any]:
        return {"ner": "capitalised n-grams", "version": VERSION, "max_words": self.max_words}

    def names(self, text: str) -> list[str]:
        """The names of one text, unique by entity_key, in order of first mention."""
        words = [(m.group(), m.start(), m.end()) for m in _WORD.finditer(text)]
        lower = {w.casefold() for w, _, _ in words if w[0].islower()}
        inner = {w for i, (w, s, _) in enumerate(words) if _capitalised(w) and not self._starts(text, words, i)}
        runs = list(self._runs(text, words))
        alone = {run[0][0] for run in runs if len(run) == 1 and not self._starts(text, words, run[0][3])}
        seen: dict[str, str] = {}
        for run in runs:
            first = run[0][0]
            if self._starts(text, words, run[0][3]) and first not in inner and (
                    len(run) != 2 or first.casefold() in lower or run[1][0] in alone):
                run = run[1:]
            for k in range(0, len(run), self.max_words):
                piece = run[k : k + self.max_words]
                name = normalize_entity(text[piece[0][1] : piece[-1][2]])
                if name and (len(piece) > 1 or len(name) > 1):
                    seen.setdefault(entity_key(name), name)
        return list(seen.values())

    @staticmethod
    def _starts(text: str, words: list, i: int) -> bool:
        """Whether word i starts a sentence (the text's first word, or one after ., !, ?, a colon or a paragraph)."""
        return i == 0 or bool(_SENTENCE_END.search(text[words[i - 1][2] : words[i][1]]))

    @staticmethod
    def _runs(text: str, words: list) -> Iterator[list]:
        """Maximal runs of capitalised words separated by spaces alone: [(word, start, end, index), ...]."""
        run: list = []
        for i, (w, s, e) in enumerate(words):
            joined = run and text[run[-1][2] : s].strip() == ""
            if _capitalised(w) and (not run or joined):
                run.append((w, s, e, i))
                continue
            if run:
                yield run
            run = [(w, s, e, i)] if _capitalised(w) else []
        if run:
            yield run

    def extract(self, texts: Iterable[str]) -> Iterator[list[str]]:
        for text in texts:
            yield self.names(text)
