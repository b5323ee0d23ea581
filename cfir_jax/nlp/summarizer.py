"""Document summarisers: BART-large-CNN with CFIR's generation settings (the project's own Flax BART, bucketed jit:
`nlp.bart_summarizer`, re-exported here), or extractive."""

from __future__ import annotations

import collections
import hashlib
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from cfir_jax.core.errors import CfirError
from cfir_jax.data.corpus import Document
from cfir_jax.nlp.bart_summarizer import (  # noqa: F401 - the summarizers' one module for their users
    ARCHITECTURES,
    BartSummarizer,
    abstract_bart,
    data_parallel,
    generation_settings,
    generation_shardings,
    resolve_model_dir,
    row_buckets,
)


class Summarizer(Protocol):
    """What the summary store needs of a summarizer."""

    name: str

    @property
    def settings(self) -> dict[str, Any]: ...

    def summarize(self, texts: list[str]) -> list[str]: ...


class CachedSummarizer:
    """A summarizer with a bounded cache of its summaries by the document's hash (SHA-256 of its text): a document
    asked again (a page refreshed, a client retrying, several users reading the same article) costs a lookup, not a
    generation. The least recently used summary goes first past `max_entries`; a batch's duplicates are generated
    once. The summaries are the inner summarizer's own, so the output never changes."""

    def __init__(self, inner: Summarizer, max_entries: int):
        if max_entries < 1:
            raise CfirError(f"summary cache: max_entries={max_entries} must be >= 1")
        self.inner, self.max_entries = inner, int(max_entries)
        self.name = inner.name
        self._cache: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @property
    def settings(self) -> dict[str, Any]:
        return self.inner.settings

    def __len__(self) -> int:
        return len(self._cache)

    def summarize(self, texts: list[str]) -> list[str]:
        keys = [hashlib.sha256(t.encode("utf-8", "surrogatepass")).digest() for t in texts]
        with self._lock:
            found = {k: self._cache[k] for k in keys if k in self._cache}
            for k in found:
                self._cache.move_to_end(k)
        todo = {k: t for k, t in zip(keys, texts) if k not in found}  # one generation per distinct text
        made = dict(zip(todo, self.inner.summarize(list(todo.values())))) if todo else {}
        with self._lock:
            self.hits += len(keys) - len(todo)
            self.misses += len(todo)
            for k, summary in made.items():
                self._cache[k] = summary
                self._cache.move_to_end(k)
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        return [found[k] if k in found else made[k] for k in keys]


# Named choices of what a document's summary is made from: the list fields (document metadata) appended to its text.
# "paper": the text alone (the paper's four fields). "authors": the authors' code also appends str() of the category,
# media and hierachy lists; here each list's items are joined with spaces (the same words without Python's brackets
# and quotes), and the fields with spaces where that code leaves no separator.
SUMMARY_INPUTS: dict[str, tuple[str, ...]] = {"paper": (), "authors": ("category", "media", "hierachy")}


def summary_input(doc: Document, fields: str = "paper") -> str:
    """The text summarised for `doc` under the named choice `fields` (SUMMARY_INPUTS)."""
    if fields not in SUMMARY_INPUTS:
        raise CfirError(f"index.summaries.fields={fields!r}: use one of {', '.join(SUMMARY_INPUTS)}")
    missing = [f for f in SUMMARY_INPUTS[fields] if f not in doc.metadata]
    if missing:
        raise CfirError(f"index.summaries.fields={fields!r} needs the {', '.join(missing)} lists, which document "
                        f"{doc.doc_id!r} does not have (synthetic corpora have none; an AToMiC corpus built before "
                        "they were kept must be rebuilt: delete W/corpus)")
    parts = [doc.text] + [" ".join(doc.metadata[f]) for f in SUMMARY_INPUTS[fields]]
    return " ".join(p for p in parts if p)


# A sentence ends at . ! or ? (optionally followed by closing quotes/brackets) before whitespace and a capital,
# digit or opening quote. Abbreviations ("Mr. Smith") split wrongly, which only shortens the summary by a sentence.
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"'”’)\]]*\s+(?=[\"'“‘(\[]?[A-Z0-9])")
# Other languages' texts: any script's capitals ("À", "É", "Ж") start a sentence too, and guillemets close one.
_ANY_END = re.compile(r"(?<=[.!?…])[\"'”’)\]»]*\s+")


def split_sentences(text: str, any_script: bool = False) -> list[str]:
    """Splits text into sentences with a punctuation rule (no model): deterministic and fast. English's rule needs
    an ASCII capital or a digit after the end; `any_script` takes any letter that is not lower case."""
    text = re.sub(r"\s+", " ", text).strip()
    if not text:
        return []
    if not any_script:
        return [s for s in _SENTENCE_END.split(text) if s]
    out: list[str] = []
    for piece in (p for p in _ANY_END.split(text) if p):
        first = next((c for c in piece if c.isalnum()), "")
        if out and (not first or first.islower()):
            out[-1] = f"{out[-1]} {piece}"  # "etc. la suite": not a new sentence
        else:
            out.append(piece)
    return out


class ExtractiveSummarizer:
    """The leading sentences of a document, up to `max_tokens` tokens: a fast, deterministic CPU alternative to BART.

    Leading sentences, because encyclopaedic sections (AToMiC) put their topic first. The budget counts whitespace
    words, or the tokens of `tokenizer` (a callable str -> sequence of tokens, e.g. the BEiT-3 text tokenizer's
    `tokenize`) so that the summary fills the encoder's 64 text tokens without being cut there. Whole sentences are
    kept while they fit; when even the first does not, it is cut at the budget.
    """

    name = "extractive"

    def __init__(self, max_tokens: int = 64, tokenizer: Callable[[str], Sequence[Any]] | None = None,
                 any_script: bool = False):
        if max_tokens < 1:
            raise CfirError(f"ExtractiveSummarizer: max_tokens={max_tokens} must be >= 1")
        self.max_tokens = max_tokens
        self.tokenizer = tokenizer
        self.any_script = any_script  # sentences of any script (`split_sentences`): the other languages'

    @property
    def settings(self) -> dict[str, Any]:
        tokenizer = "words" if self.tokenizer is None else getattr(self.tokenizer, "__qualname__", repr(self.tokenizer))
        return {"max_tokens": self.max_tokens, "budget_unit": tokenizer,
                **({"sentences": "any script"} if self.any_script else {})}

    def _count(self, text: str) -> int:
        return len(text.split()) if self.tokenizer is None else len(self.tokenizer(text))

    def _cut(self, sentence: str) -> str:
        """The longest word prefix of `sentence` within the budget (binary search: token counts grow with words)."""
        words = sentence.split()
        lo, hi = 0, len(words)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._count(" ".join(words[:mid])) <= self.max_tokens:
                lo = mid
            else:
                hi = mid - 1
        return " ".join(words[:lo])

    def summarize_one(self, text: str) -> str:
        kept: list[str] = []
        for sentence in split_sentences(text, self.any_script):
            candidate = " ".join([*kept, sentence])
            if self._count(candidate) <= self.max_tokens:
                kept.append(sentence)
            elif not kept:
                return self._cut(sentence)
            else:
                break
        return " ".join(kept)

    def summarize(self, texts: list[str]) -> list[str]:
        return [self.summarize_one(text) for text in texts]


def no_repeat_ngram_mask(sequences, cur_len, ngram_size: int, vocab_size: int):
    """`nlp.ngram.no_repeat_ngram_mask` (the dense no-repeat n-gram rule of the beam search)."""
    # why: jax stays off the extractive summarizer's path.
    from cfir_jax.nlp import ngram

    return ngram.no_repeat_ngram_mask(sequences, cur_len, ngram_size, vocab_size)


def make_summarizer(config, summarizer: str | None = None, bart_model: str = "", any_script: bool = False):
    """The summarizer index.summaries configures; `summarizer` names another kind with the same settings (the
    query-time choice retrieval.summarizer='extractive', a language's in index.languages), `bart_model` another
    BART, `any_script` sentences of another language than English."""
    s = config.index.summaries
    kind = summarizer or s.summarizer
    if kind == "extractive":
        return ExtractiveSummarizer(max_tokens=s.extractive_tokens, any_script=any_script)
    if kind == "bart":
        return BartSummarizer(bart_model or s.bart_model, max_length=s.max_length, min_length=s.min_length,
                              num_beams=s.num_beams,
                              length_penalty=s.length_penalty, no_repeat_ngram_size=s.no_repeat_ngram_size,
                              max_input_tokens=s.max_input_tokens, batch_size=s.batch_size,
                              dtype=s.dtype)
    raise CfirError(f"index.summaries.summarizer={kind!r}: use 'bart' or 'extractive'")
