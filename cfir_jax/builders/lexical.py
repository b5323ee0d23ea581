"""The lexical stage's build (beyond the paper): each cached image's own text as BM25 terms, scored once by
`bm25s` into the store that `cfir_jax.stores.lexical` reads, and the store's three changes of the collection.

- build (`build_lexical`): the terms of every row of the image cache (`cfir_jax.stores.lexical.terms`), then bm25s's
  eager scoring of every (term, row) pair.
- after an add (`extend_lexical`): the new rows' terms appended (new terms grow the vocabulary), then every pair
  re-scored from the stored terms: N, the mean length and each idf change with the collection, and re-scoring reads
  no corpus text but the new rows'.
- after a remove: nothing here. Removed rows stay in the store (and in its N and idf, as they stay in the image
  cache) and are dropped from every answer by the query side (`cfir_jax.search.live_rows`, from the cache's mask).
- after a compact (`compact_lexical`): the live rows' terms kept in row order, re-scored.
Each writes a complete store through `atomic_dir` (manifest, checksums; `index.py --verify` reads it).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from cfir_jax.builders.descriptor import EXTEND, REMAP, Build, Changes, Stage, StageRun, Step, declare
from cfir_jax.builders.image_cache_update import row_map
from cfir_jax.builders.image_text import FIELDS, image_text
from cfir_jax.builders.store_update import ChangeRun
from cfir_jax.core.errors import CfirError
from cfir_jax.core.languages import REFERENCE, by_language, setup_of
from cfir_jax.core.progress import bar as progress_bar
from cfir_jax.core.progress import shown
from cfir_jax.stores.contract import StoreError, atomic_dir, write_manifest
from cfir_jax.stores.lexical import FORMAT_VERSION, KIND, METHODS, READER, LexicalIndex, terms

if TYPE_CHECKING:
    from cfir_jax.data.corpus import Corpus
    from cfir_jax.stores.image_cache import ImageCache


def settings_of(cfg) -> dict:
    """The manifest fields a store's scores depend on, from the config section index.lexical (checked here)."""
    fields = list(cfg.fields)
    unknown = [f for f in fields if f not in FIELDS]
    if not fields or unknown:
        raise CfirError(f"index.lexical.fields={fields!r}: choose among {', '.join(FIELDS)}")
    if cfg.method not in METHODS:
        raise CfirError(f"index.lexical.method={cfg.method!r}: choose among {', '.join(METHODS)}")
    if float(cfg.k1) < 0 or not 0 <= float(cfg.b) <= 1:
        raise CfirError(f"index.lexical: k1={cfg.k1} must be >= 0 and b={cfg.b} in [0, 1]")
    return dict(fields=fields, method=str(cfg.method), k1=float(cfg.k1), b=float(cfg.b), stemmer=str(cfg.stemmer))


def _ids_sha(ids: Sequence[str]) -> str:
    return hashlib.sha256("\n".join(ids).encode()).hexdigest()[:16]


def row_texts(corpus: Corpus, ids: Sequence[str], fields: Sequence[str]) -> list[str]:
    """The own text of each image `ids` (cache rows) names, '' where it has none."""
    row_of = {image_id: r for r, image_id in enumerate(corpus.image_ids)}
    return [image_text(corpus.image(row_of[i]), fields) for i in ids]


def row_langs(corpus: Corpus, ids: Sequence[str]) -> list[str] | None:
    """The language of each image `ids` names ('' without text), or None when the corpus' are all English."""
    if not corpus.image_langs:
        return None
    row_of = {image_id: r for r, image_id in enumerate(corpus.image_ids)}
    return [corpus.image_langs[row_of[i]] for i in ids]


def language_settings(config, langs: Sequence[str] | None) -> dict:
    """The manifest fields of a store over captions not all in English: each caption language's stemmer
    (index.languages: English's is index.lexical.stemmer) and its rows; {} for English ones."""
    counts = Counter(x for x in langs or () if x)
    if not set(counts) - {REFERENCE}:
        return {}
    return {"languages": {c: setup_of(config, c).stemmer for c in sorted(counts)},
            "language_rows": dict(sorted(counts.items()))}


def tokenize(texts: Sequence[str], vocab: dict[str, int], stemmer: str, progress: bool | None = None,
             langs: Sequence[str] | None = None, stemmers: dict[str, str] | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
    """(offsets int64 [n + 1], term ids int32 [T]) of `texts`; unseen terms are added to `vocab` (in place). With
    `langs` (each text's language) and `stemmers` (each language's), a text's terms are its language's."""
    lengths, ids = np.zeros(len(texts) + 1, np.int64), []
    with progress_bar(total=len(texts), desc="lexical terms", unit="img", show=progress) as bar:
        for i, text in enumerate(texts):
            lang = langs[i] or REFERENCE if langs is not None and stemmers else REFERENCE
            read = terms(text, stemmers[lang], lang) if lang != REFERENCE else terms(text, stemmer)
            row = [vocab.setdefault(t, len(vocab)) for t in read]
            lengths[i + 1] = len(row)
            ids.extend(row)
            bar.update(1)
    return np.cumsum(lengths), np.asarray(ids, np.int32)


def score(offsets: np.ndarray, doc_terms: np.ndarray, vocab_size: int, settings: dict
          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The score matrix by term: (indptr int64 [V + 1], indices int32 [P], data float32 [P]).

    bm25s's own idf and tf functions of `settings["method"]` (`bm25s.scoring`), applied to every (row, term) pair at
    once: the matrix `bm25s.BM25.index` builds (tests/unit/stores/test_lexical.py holds them equal), without its loop
    over the rows in Python and its lists of lists (4M captions: minutes and gigabytes)."""
    n, vocab_size = len(offsets) - 1, int(vocab_size)
    lengths = np.diff(offsets)
    if not len(doc_terms):  # no row has a term: nothing to score
        return np.zeros(vocab_size + 1, np.int64), np.zeros(0, np.int32), np.zeros(0, np.float32)
    key = np.repeat(np.arange(n, dtype=np.int64), lengths) * vocab_size + doc_terms
    key, tf = np.unique(key, return_counts=True)  # by row, then term
    row, term = key // vocab_size, key % vocab_size
    del key
    df = np.bincount(term, minlength=vocab_size)
    # why: importing bm25s runs a JAX computation (stores.lexical.stopwords says why it waits until it is needed)
    from bm25s import scoring as bm25s_scoring

    idf_of = bm25s_scoring._select_idf_scorer(settings["method"])
    idf = np.array([idf_of(int(d), N=n) if d else 0.0 for d in df], np.float32)
    tfc = bm25s_scoring._select_tfc_scorer(settings["method"])(
        tf_array=tf.astype(np.float32), l_d=lengths[row].astype(np.float32), l_avg=float(lengths.mean()),
        k1=settings["k1"], b=settings["b"], delta=None)
    data = (idf[term] * tfc).astype(np.float32)
    order = np.argsort(term, kind="stable")  # by term, then row (the keys were sorted by row)
    indptr = np.zeros(vocab_size + 1, np.int64)
    np.cumsum(df, out=indptr[1:])
    return indptr, row[order].astype(np.int32), data[order]


def write_store(out_dir: str | os.PathLike, vocab: dict[str, int], offsets: np.ndarray, doc_terms: np.ndarray,
                settings: dict, cache: ImageCache, start: float) -> LexicalIndex:
    """Scores and writes a complete store for the rows of `cache` (whose terms are offsets/doc_terms)."""
    if len(offsets) != cache.num_images + 1:
        raise StoreError(f"{out_dir}: {len(offsets) - 1} rows of terms for an image cache of {cache.num_images}")
    words = sorted(vocab, key=vocab.get)
    indptr, indices, data = score(offsets, doc_terms, len(words), settings)
    with atomic_dir(out_dir) as tmp:
        (tmp / "vocab.json").write_text(json.dumps(words, ensure_ascii=False), encoding="utf-8")
        for name, array in (("indptr", indptr), ("indices", indices), ("data", data), ("doc_offsets", offsets),
                            ("doc_terms", doc_terms)):
            np.save(tmp / f"{name}.npy", array)
        write_manifest(tmp, KIND, FORMAT_VERSION, **settings, cache_fingerprint=cache.content_fingerprint,
                       ids_sha=_ids_sha(cache.ids), num_rows=cache.num_images, vocab_size=len(words),
                       num_postings=int(len(indices)), num_with_text=int((np.diff(offsets) > 0).sum()),
                       mean_terms=round(float(len(doc_terms)) / max(1, cache.num_images), 3),
                       build_seconds=round(time.time() - start, 3))
    return LexicalIndex.open(out_dir)


def build_lexical(out_dir: str | os.PathLike, corpus: Corpus, cache: ImageCache, settings: dict,
                  progress: bool | None = None) -> LexicalIndex:
    """The store for every row of `cache`; a current one (same cache build and settings, its captions' languages
    read by the same stemmers: `settings["languages"]`, absent for English captions) is reused."""
    try:
        store = LexicalIndex.open(out_dir, cache_fingerprint=cache.content_fingerprint, num_rows=cache.num_images,
                                  **settings)
        if store.manifest.get("languages") == settings.get("languages"):
            return store
    except StoreError:
        pass
    start, vocab = time.time(), {}
    offsets, doc_terms = tokenize(row_texts(corpus, cache.ids, settings["fields"]), vocab, settings["stemmer"],
                                  progress, row_langs(corpus, cache.ids), settings.get("languages"))
    return write_store(out_dir, vocab, offsets, doc_terms, settings, cache, start)


def extend_lexical(out_dir: str | os.PathLike, store: LexicalIndex, corpus: Corpus, cache: ImageCache,
                   config=None) -> LexicalIndex:
    """After an add: `store` (the first store.num_rows rows of `cache`) with the new rows' terms, re-scored, into
    `out_dir` (a new version's directory, or the store's own); the new rows' terms in their languages (the stemmers
    of `config`'s index.languages for a language the store had none of)."""
    start, settings = time.time(), _settings(store)
    langs = row_langs(corpus, cache.ids)
    grown = language_settings(config, langs) if config is not None else {}
    if grown:  # the store's own stemmers stay those of its languages
        settings.update(language_rows=grown["language_rows"],
                        languages={**grown["languages"], **(store.manifest.get("languages") or {})})
    if cache.num_images < store.num_rows or list(cache.ids[: store.num_rows]) != _ids_prefix(store, cache):
        raise StoreError(f"{store.path}: the image cache does not extend the rows this store was built for; rebuild "
                         "it with index.py --stages lexical")
    vocab = {t: j for j, t in enumerate(store.vocab)}
    texts = row_texts(corpus, cache.ids[store.num_rows :], settings["fields"])
    new_offsets, new_terms = tokenize(texts, vocab, settings["stemmer"], False, langs and langs[store.num_rows :],
                                      settings.get("languages"))
    offsets = np.concatenate([store.doc_offsets, store.doc_offsets[-1] + new_offsets[1:]])
    doc_terms = np.concatenate([np.asarray(store.doc_terms), new_terms])
    return write_store(out_dir, vocab, offsets, doc_terms, settings, cache, start)


def compact_lexical(out_dir: str | os.PathLike, store: LexicalIndex, keep: np.ndarray, cache: ImageCache,
                    langs: Sequence[str] | None = None) -> LexicalIndex:
    """After a compact: the rows `keep` (ascending old rows, those the compacted `cache` holds, in its order) with
    their terms, re-scored into `out_dir`. Terms no kept row has stay in the vocabulary, with no postings. `langs`:
    the kept rows' languages (a store over captions not all in English counts its rows per language)."""
    start, settings = time.time(), _settings(store)
    if "language_rows" in settings and langs is not None:
        settings["language_rows"] = dict(sorted(Counter(x for x in langs if x).items()))
    keep = np.asarray(keep, np.int64)
    if len(keep) != cache.num_images or (len(keep) and (keep.min() < 0 or keep.max() >= store.num_rows)):
        raise StoreError(f"{store.path}: compaction keeps {len(keep)} rows but the compacted cache has "
                         f"{cache.num_images}; rebuild it with index.py --stages lexical")
    lo, hi = store.doc_offsets[keep], store.doc_offsets[keep + 1]
    offsets = np.zeros(len(keep) + 1, np.int64)
    np.cumsum(hi - lo, out=offsets[1:])
    doc_terms = np.asarray(store.doc_terms)[_ranges(lo, hi)] if len(keep) else np.zeros(0, np.int32)
    vocab = {t: j for j, t in enumerate(store.vocab)}
    return write_store(out_dir, vocab, offsets, doc_terms, settings, cache, start)


def _ranges(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The concatenation of arange(lo[i], hi[i]) over i, vectorised."""
    lengths = hi - lo
    starts = np.repeat(lo - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
    return starts + np.arange(int(lengths.sum()))


def _settings(store: LexicalIndex) -> dict:
    return {k: store.manifest[k] for k in ("fields", "method", "k1", "b", "stemmer", "languages", "language_rows")
            if k in store.manifest}


def _ids_prefix(store: LexicalIndex, cache: ImageCache) -> list[str]:
    """The cache's first store.num_rows ids when they are the rows the store was built for (its ids_sha)."""
    ids = list(cache.ids[: store.num_rows])
    return ids if _ids_sha(ids) == store.manifest["ids_sha"] else []


def lexical_wanted(run: StageRun) -> bool:
    """Whether index.py builds W/lexical: asked for (index.lexical.enabled)."""
    return bool(run.config.index.lexical.enabled)


def build_stage(run: StageRun) -> None:
    """Stage lexical, on process 0 alone (minutes at millions of captions; the others wait, then open it): nothing
    when the corpus' images carry no text."""
    corpus, cache = run.opened["corpus"], run.opened["image_cache"]
    if corpus.manifest.get("images_with_text"):
        settings = {**settings_of(run.config.index.lexical),
                    **language_settings(run.config, row_langs(corpus, cache.ids))}
        build_lexical(run.layout.lexical, corpus, cache, settings, shown())


def open_stage(run: StageRun) -> LexicalIndex | None:
    """What every process opens after the stage: None (skipped) when the corpus' images carry no text."""
    if not run.opened["corpus"].manifest.get("images_with_text"):
        return None
    return LexicalIndex.open(run.layout.lexical, cache_fingerprint=run.opened["image_cache"].content_fingerprint,
                             **settings_of(run.config.index.lexical))


def stage_summary(store: LexicalIndex | None) -> str:
    """The stage's line of index.py's closing table."""
    if store is None:
        return "skipped: the corpus' images have no text"
    m = store.manifest
    stems = {c: f"{x or 'no'} stemmer" for c, x in (m.get("languages") or {}).items()}
    return (f"{m['num_with_text']:,} of {m['num_rows']:,} images with text, {m['vocab_size']:,} terms, "
            f"{m['num_postings']:,} postings ({m['method']}, k1={m['k1']:g}, b={m['b']:g})") + \
        (f"; {by_language(m['language_rows'], stems)}" if stems else "")


def lexical_after_add(change: ChangeRun, out) -> dict:
    """W/lexical with the new cache rows' terms appended and every row re-scored (the corpus statistics moved)."""
    old, cache = change.old("lexical"), change.new("image_cache")
    store = extend_lexical(out, old, change.new("corpus"), cache, change.config)
    return {"rows": store.num_rows, "added_images": store.num_rows - old.num_rows}


def lexical_after_compaction(change: ChangeRun, out) -> dict:
    """W/lexical without the rows the compaction dropped (the image cache's row map), re-scored. A removal alone
    needs no step: the removed rows stay in the statistics and the search drops them (search.live_rows)."""
    cache = change.new("image_cache")
    store = compact_lexical(out, change.old("lexical"), np.flatnonzero(row_map(change) >= 0), cache,
                            row_langs(change.new("corpus"), cache.ids))
    return {"rows": store.num_rows}


declare(Stage("lexical", reader=READER,
              build=Build(build_stage, stage_summary, every_host=False, open=open_stage, wanted=lexical_wanted),
              changes=Changes(add=Step(EXTEND, lexical_after_add), compact=Step(REMAP, lexical_after_compaction))))
