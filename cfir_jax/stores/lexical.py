"""The lexical store: BM25 over what each image says about itself, for names the text tower never learned.

Beyond the paper. ER finds an entity's images by embedding its name; a name the frozen text tower never learned (a
local councillor, a village) finds noise. An image's own text (AToMiC's three caption fields; `caption` of a files
collection, kept as `caption_reference_description`) often names it. This store scores those texts with BM25 so that a
document can be the query: the `bm25` method (the document alone), and CFIR with BM25's top M images in its union
(`cfir_bm25`) or its ranking fused with BM25's (`cfir_bm25_fused`; `cfir_jax.retrieve.methods`).

Text to terms (`terms`, the same for images and queries): NFC-normalised (an "ü" typed as "u" and a combining
diaeresis is one letter, not a split), lower-cased, split by bm25s's default pattern
`(?u)\\b\\w\\w+\\b` (words of two or more word characters), bm25s's English stop words dropped
(`bm25s.stopwords.STOPWORDS_EN`), then stemmed by PyStemmer's Snowball English stemmer (`stemmer=""`: no stemming).
The BM25 scores of every (term, image) pair are computed once by `bm25s` (eager sparse scoring) with
`method`, `k1`, `b` from the config; "robertson" (the default) is idf = log((N - df + 0.5) / (df + 0.5)) floored at 0,
tf part tf / (tf + k1 (1 - b + b |d| / avgdl)), which equals `rank_bm25.BM25Okapi(epsilon=0)` divided by (k1 + 1)
(tests/unit/stores/test_lexical.py holds them equal). "lucene" and "atire" are also accepted (no non-occurrence
scores: an image without a query term gets nothing from it).

Layout of the store (kind "lexical", format 2: format 1 read its terms without NFC; index.py rebuilds such a store),
rows in the image cache's row order:
  vocab.json        [V] the terms; column j of the score matrix is vocab[j]
  indptr.npy        int64 [V + 1]  term j's postings are indices/data[indptr[j]:indptr[j + 1]]
  indices.npy       int32 [P]      image rows, ascending within a term
  data.npy          float32 [P]    BM25 score of (term, image)
  doc_offsets.npy   int64 [N + 1]  image r's terms are doc_terms[doc_offsets[r]:doc_offsets[r + 1]]
  doc_terms.npy     int32 [T]      the term ids of every image, in text order (a change of the collection re-scores
                                   from them without reading the corpus again)
  manifest.json     fields, method, k1, b, stemmer, the image cache build it follows, counts

A query is scored term by term over the postings of its terms (`cfir_jax.search.bm25`), each term weighted by its
count in the query (as rank_bm25 and a bag-of-words Lucene query do), then cut to the live rows and its top k.

Languages (`cfir_jax.core.languages`, docs/languages.md). A store over captions that are not all English records the
stemmer of each caption language (`languages`, and `language_rows`): each caption's terms are its own language's,
stop words and stems. A query's terms are its language's; with `union` (index.languages.query_stemming) also each
caption language's, so a French query meets a French caption by its French stems and an English one by its English
stems (a name stemmed in French, "Walker" -> "walk", would miss "walker"), a term read once at its highest count. An
English store records neither, and its English queries read exactly the terms they read before.
"""

from __future__ import annotations

import functools
import json
import re
import unicodedata
from pathlib import Path

import numpy as np
import Stemmer

from cfir_jax.core.errors import StoreError
from cfir_jax.core.languages import REFERENCE, SNOWBALL
from cfir_jax.stores.contract import Store
from cfir_jax.stores.integrity import check_csr
from cfir_jax.stores.readers import Reader, register

KIND = "lexical"
FORMAT_VERSION = 2
METHODS = ("robertson", "lucene", "atire")  # bm25s's variants without non-occurrence scores
SPLIT = re.compile(r"(?u)\b\w\w+\b")  # bm25s's default splitter


# bm25s's stop word list of each language that has one (ISO 639-1 code -> its name in bm25s.stopwords).
STOPWORD_LISTS = {"en": "STOPWORDS_EN", "fr": "STOPWORDS_FRENCH", "de": "STOPWORDS_GERMAN", "nl": "STOPWORDS_DUTCH",
                  "es": "STOPWORDS_SPANISH", "pt": "STOPWORDS_PORTUGUESE", "it": "STOPWORDS_ITALIAN",
                  "ru": "STOPWORDS_RUSSIAN", "sv": "STOPWORDS_SWEDISH", "no": "STOPWORDS_NORWEGIAN",
                  "da": "STOPWORDS_DANISH", "tr": "STOPWORDS_TURKISH", "ko": "STOPWORDS_KOREAN",
                  "zh": "STOPWORDS_CHINESE"}


@functools.lru_cache(maxsize=16)
def stopwords(language: str = REFERENCE) -> frozenset[str]:
    """bm25s's stop words of `language` (English's by default; none for a language bm25s has no list of)."""
    if language not in STOPWORD_LISTS:
        return frozenset()
    # Its import runs a JAX computation, which would start the XLA backend before a multi-host build's
    # jax.distributed.initialize.
    # why: bm25s loads on the first terms, not on this module's import
    from bm25s import stopwords as lists

    return frozenset(getattr(lists, STOPWORD_LISTS[language]))


@functools.lru_cache(maxsize=4)
def _stemmer(language: str):
    return Stemmer.Stemmer(language) if language else None


def terms(text: str, stemmer: str = "english", language: str = REFERENCE, also_stop: str | None = None) -> list[str]:
    """The BM25 terms of `text` in `language`: NFC-normalised, lower-cased words of 2+ characters, its stop words
    (and `also_stop`'s: a query's own language's) dropped, stemmed by `stemmer`."""
    stop = stopwords(language) if also_stop in (None, language) else stopwords(language) | stopwords(also_stop)
    words = [w for w in SPLIT.findall(unicodedata.normalize("NFC", text).lower()) if w not in stop]
    stem = _stemmer(stemmer)
    return stem.stemWords(words) if stem is not None and words else words


class LexicalIndex(Store):
    """The complete store opened for reading: the BM25 score matrix by term, the vocabulary, each row's terms."""

    KIND, VERSION, STAGE = KIND, FORMAT_VERSION, "lexical"

    def __init__(self, path: Path, manifest: dict, vocab: list[str], indptr: np.ndarray, indices: np.ndarray,
                 data: np.ndarray, doc_offsets: np.ndarray, doc_terms: np.ndarray):
        self.path, self.manifest, self.vocab = path, manifest, vocab
        self.indptr, self.indices, self.data = indptr, indices, data
        self.doc_offsets, self.doc_terms = doc_offsets, doc_terms
        self.column = {t: j for j, t in enumerate(vocab)}

    @classmethod
    def load(cls, path: Path, manifest: dict) -> LexicalIndex:
        try:
            vocab = json.loads((path / "vocab.json").read_text(encoding="utf-8"))
            arrays = {name: np.load(path / f"{name}.npy", mmap_mode="r")
                      for name in ("indptr", "indices", "data", "doc_offsets", "doc_terms")}
        except (OSError, ValueError) as e:
            raise StoreError(f"{path}: unreadable lexical store ({e.__class__.__name__}); rebuild it with index.py "
                             "--stages lexical") from None
        n, v = manifest.get("num_rows"), manifest.get("vocab_size")
        if len(vocab) != v or len(arrays["indptr"]) != v + 1 or len(arrays["doc_offsets"]) != n + 1 or \
                len(arrays["indices"]) != len(arrays["data"]):
            raise StoreError(f"{path}: arrays disagree with the manifest ({n} rows, {v} terms); rebuild it with "
                             "index.py --stages lexical")
        check_csr(np.asarray(arrays["indptr"]), arrays["indices"], n, path)
        check_csr(np.asarray(arrays["doc_offsets"]), arrays["doc_terms"], v, path)
        return cls(path, manifest, vocab, np.asarray(arrays["indptr"]), arrays["indices"], arrays["data"],
                   np.asarray(arrays["doc_offsets"]), arrays["doc_terms"])

    @property
    def num_rows(self) -> int:
        return int(self.manifest["num_rows"])

    def query_terms(self, text: str, lang: str = REFERENCE, union: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """(term columns [u] of the store's vocabulary, their counts in `text` [u]) of a query in `lang`; unknown
        terms dropped. `union`: also its terms as each caption language of the store reads them (module docstring)."""
        stemmers = self.manifest.get("languages") or {REFERENCE: self.manifest["stemmer"]}
        own = stemmers.get(lang, SNOWBALL.get(lang, ""))
        readings = [(lang, own)] + ([(c, x) for c, x in stemmers.items() if c != lang] if union else [])
        best: dict[int, float] = {}
        for code, stemmer in readings:
            cols = [j for t in terms(text, stemmer, code, also_stop=lang) if (j := self.column.get(t)) is not None]
            for j, n in zip(*np.unique(np.asarray(cols, np.int64), return_counts=True)):
                best[int(j)] = max(best.get(int(j), 0.0), float(n))
        if not best:
            return np.zeros(0, np.int64), np.zeros(0, np.float32)
        uniq = np.asarray(sorted(best), np.int64)
        return uniq, np.asarray([best[j] for j in uniq], np.float32)


# Retrieval opens it for the BM25 methods, held to the image cache it was built from.
READER = register(Reader(KIND, LexicalIndex.open, asked=lambda config, method: method.uses_lexical,
                         expect=lambda opened: {"cache_fingerprint": opened.cache.content_fingerprint,
                                                "num_rows": opened.cache.num_images}))
