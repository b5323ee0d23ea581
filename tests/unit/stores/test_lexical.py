"""The lexical store: BM25 scores equal to rank_bm25's, pruning, removed rows, and the store after add and compact
equal to a fresh build."""

import bm25s
import numpy as np
import pytest
from rank_bm25 import BM25Okapi

from cfir_jax.builders.lexical import build_lexical, compact_lexical, extend_lexical, score, tokenize
from cfir_jax.core.errors import StoreError
from cfir_jax.search.bm25 import BM25Search, Pruning
from cfir_jax.search.live_rows import LiveRows
from cfir_jax.stores.lexical import LexicalIndex, terms

SETTINGS = dict(fields=["caption_reference_description"], method="robertson", k1=1.2, b=0.75, stemmer="english")
WORDS = ["bridge", "councillor", "opens", "river", "westford", "harbour", "mayor", "station", "museum", "painting",
         "village", "church", "market", "festival", "portrait", "ship", "railway", "garden", "tower", "castle"]


def random_texts(n, seed=0, rare=()):
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, len(WORDS) + 1)  # Zipf-like: a few common words, many rarer ones
    texts = [" ".join(rng.choice(WORDS, rng.integers(3, 15), p=p / p.sum())) for _ in range(n)]
    for i, name in rare:
        texts[i] += f" {name}"
    return texts


def test_scores_and_top10_equal_rank_bm25():
    """bm25s 'robertson' = rank_bm25.BM25Okapi with epsilon=0 (a negative idf floored at 0, not at a share of the
    mean idf), divided by (k1 + 1): same k1, b and terms; every query term counted as often as it occurs."""
    texts = random_texts(300, rare=[(7, "Roe"), (123, "Roe Roe"), (200, "Zanzibar")])
    vocab = {}
    offsets, doc_terms = tokenize(texts, vocab, "english")
    indptr, indices, data = score(offsets, doc_terms, len(vocab), SETTINGS)
    search = BM25Search(indptr, indices, data, len(texts))
    reference = BM25Okapi([terms(t) for t in texts], k1=1.2, b=0.75, epsilon=0.0)
    rng = np.random.default_rng(1)
    queries = [" ".join(rng.choice(WORDS + ["roe", "zanzibar", "unknownword"], 30)) for _ in range(20)]
    for q in queries:
        q_terms = terms(q)
        want = reference.get_scores(q_terms) / (1.2 + 1)
        cols = [vocab[t] for t in q_terms if t in vocab]
        uniq, counts = np.unique(cols, return_counts=True)
        got_s, got_r = search.search(uniq, counts.astype(np.float32), 10)
        want_r = np.lexsort((np.arange(len(want)), -want))[:10]
        np.testing.assert_array_equal(got_r, want_r)
        np.testing.assert_allclose(got_s, want[want_r], rtol=1e-5)
    assert min(reference.idf.values()) == 0.0 < max(reference.idf.values())  # a common term's idf was floored


@pytest.mark.parametrize("method", ["robertson", "lucene", "atire"])
def test_score_matrix_equals_bm25s_index(method):
    texts = random_texts(200, seed=5, rare=[(4, "")])
    vocab = {}
    offsets, doc_terms = tokenize(texts, vocab, "english")
    settings = dict(SETTINGS, method=method, k1=1.5, b=0.6)
    indptr, indices, data = score(offsets, doc_terms, len(vocab), settings)
    docs = [doc_terms[offsets[r] : offsets[r + 1]].tolist() for r in range(len(texts))]
    want = bm25s.BM25(method=method, k1=1.5, b=0.6).build_index_from_ids(list(range(len(vocab))), docs,
                                                                          show_progress=False)
    np.testing.assert_array_equal(indptr, want["indptr"])
    np.testing.assert_array_equal(indices, want["indices"])
    np.testing.assert_allclose(data, want["data"], rtol=1e-6)


def test_terms_lowercase_stopwords_stemmed():
    assert terms("The Councillors opened the Westford bridges, a b") == ["councillor", "open", "westford", "bridg"]
    assert terms("Running dogs", stemmer="") == ["running", "dogs"]


def test_pruning_reads_rarest_terms_and_rare_name_still_wins():
    texts = random_texts(2000, rare=[(1234, "Roe")])
    vocab = {}
    offsets, doc_terms = tokenize(texts, vocab, "english")
    arrays = score(offsets, doc_terms, len(vocab), SETTINGS)
    exact = BM25Search(*arrays, len(texts))
    pruned = BM25Search(*arrays, len(texts), pruning=Pruning(max_terms=2, max_postings=0))
    q = terms("bridge councillor river roe opens")
    cols = np.array(sorted({vocab[t] for t in q}))
    chosen = cols[pruned.chosen_terms(cols)]
    assert vocab["roe"] in chosen and len(chosen) == 2
    lengths = np.diff(arrays[0])[cols]
    assert set(np.diff(arrays[0])[chosen]) <= set(np.sort(lengths)[:2])  # the two shortest posting lists
    ones = np.ones(len(cols), np.float32)
    assert pruned.search(cols, ones, 1)[1][0] == exact.search(cols, ones, 1)[1][0] == 1234
    capped = BM25Search(*arrays, len(texts), pruning=Pruning(max_postings=1))
    assert len(capped.chosen_terms(cols)) == 1  # the first term is always read


def test_removed_rows_never_returned():
    texts = random_texts(50, rare=[(3, "Roe"), (9, "Roe")])
    vocab = {}
    offsets, doc_terms = tokenize(texts, vocab, "english")
    removed = np.zeros(50, bool)
    removed[3] = True
    search = BM25Search(*score(offsets, doc_terms, len(vocab), SETTINGS), 50, live=LiveRows(removed))
    scores, rows = search.search(np.array([vocab["roe"]]), np.ones(1, np.float32), 10)
    assert list(rows) == [9]
    scores, rows = search.search(np.array([vocab["bridg"], vocab["roe"]]), np.ones(2, np.float32), 50)
    assert 3 not in rows and len(rows) == len(set(rows))


class FakeCorpus:
    """What the builder reads of a Corpus: image ids and each image's texts."""

    def __init__(self, texts):
        self.image_ids = [f"img{i}" for i in range(len(texts))]
        self.texts = texts
        self.manifest = {"images_with_text": len(texts)}
        self.image_langs = []  # an English corpus records none

    def image(self, row):
        class Image:
            texts = {"caption_reference_description": (self.texts[row],)}
        return Image()


class FakeCache:
    def __init__(self, ids, fingerprint):
        self.ids, self.num_images, self.content_fingerprint = list(ids), len(ids), fingerprint


def assert_same_store(a: LexicalIndex, b: LexicalIndex):
    for name in ("indptr", "indices", "doc_offsets", "doc_terms"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    np.testing.assert_allclose(a.data, b.data, rtol=1e-6)
    assert a.vocab == b.vocab


def test_extend_equals_a_fresh_build(tmp_path):
    texts = random_texts(120, rare=[(110, "Councillor Jane Roe opens the Westford bridge")])
    corpus = FakeCorpus(texts)
    old = build_lexical(tmp_path / "old", corpus, FakeCache(corpus.image_ids[:100], "c1"), SETTINGS)
    assert old.manifest["num_rows"] == 100 and "roe" not in old.column
    grown = extend_lexical(tmp_path / "grown", old, corpus, FakeCache(corpus.image_ids, "c2"))
    fresh = build_lexical(tmp_path / "fresh", corpus, FakeCache(corpus.image_ids, "c2"), SETTINGS)
    assert_same_store(grown, fresh)
    search = BM25Search(grown.indptr, grown.indices, grown.data, grown.num_rows)
    assert search.search(*grown.query_terms("an article about Jane Roe"), 1)[1][0] == 110
    with pytest.raises(StoreError, match="does not extend"):
        extend_lexical(tmp_path / "bad", old, corpus, FakeCache(corpus.image_ids[::-1], "c3"))


def test_compact_equals_a_fresh_build_of_the_live_rows(tmp_path):
    texts = random_texts(80, seed=3)
    corpus = FakeCorpus(texts)
    store = build_lexical(tmp_path / "all", corpus, FakeCache(corpus.image_ids, "c1"), SETTINGS)
    keep = np.array([r for r in range(80) if r % 3])
    live_ids = [corpus.image_ids[r] for r in keep]
    compacted = compact_lexical(tmp_path / "compact", store, keep, FakeCache(live_ids, "c2"))
    fresh = build_lexical(tmp_path / "fresh", corpus, FakeCache(live_ids, "c2"), SETTINGS)
    for name in ("indptr", "doc_offsets"):  # the compacted store keeps the vocabulary order of the old one
        assert len(getattr(compacted, name)) == len(getattr(fresh, name))
    for q in ("bridge river", "museum painting castle", "village church market festival"):
        a = BM25Search(compacted.indptr, compacted.indices, compacted.data, len(keep)).search(
            *compacted.query_terms(q), 10)
        b = BM25Search(fresh.indptr, fresh.indices, fresh.data, len(keep)).search(*fresh.query_terms(q), 10)
        np.testing.assert_array_equal(a[1], b[1])
        np.testing.assert_allclose(a[0], b[0], rtol=1e-6)


def test_store_is_reused_checked_and_refused_when_damaged(tmp_path):
    corpus = FakeCorpus(random_texts(30))
    store = build_lexical(tmp_path / "lex", corpus, FakeCache(corpus.image_ids, "c1"), SETTINGS)
    again = build_lexical(tmp_path / "lex", corpus, FakeCache(corpus.image_ids, "c1"), SETTINGS)
    assert again.manifest["created"] == store.manifest["created"]  # current: reused
    with pytest.raises(StoreError, match="stale"):
        LexicalIndex.open(tmp_path / "lex", cache_fingerprint="another")
    np.save(tmp_path / "lex" / "indptr.npy", np.zeros(3, np.int64))
    with pytest.raises(StoreError):
        LexicalIndex.open(tmp_path / "lex")


def test_nfd_and_nfc_spellings_are_one_term_on_both_sides(tmp_path):
    """"Zürich" typed with a combining diaeresis (NFD) and as one letter (NFC) find each other: terms are NFC on the
    image's side and on the query's."""
    nfc, nfd = "Z\u00fcrich", "Zu\u0308rich"
    texts = random_texts(40, seed=5)
    texts[11] += f" the old town of {nfc}"
    texts[29] += f" a tram in {nfd}"
    corpus = FakeCorpus(texts)
    store = build_lexical(tmp_path / "lex", corpus, FakeCache(corpus.image_ids, "c1"), SETTINGS)
    assert terms(nfd) == terms(nfc) == ["z\u00fcrich"]
    search = BM25Search(store.indptr, store.indices, store.data, store.num_rows)
    for query in (f"a document about {nfd}", f"a document about {nfc}"):
        assert sorted(search.search(*store.query_terms(query), 5)[1].tolist()) == [11, 29]


def test_a_store_of_the_older_format_is_rebuilt_not_used(tmp_path):
    """Format 1 read its terms without NFC: index.py (build_lexical) rebuilds such a store; a reader refuses it."""
    import json

    corpus = FakeCorpus(random_texts(30))
    build_lexical(tmp_path / "lex", corpus, FakeCache(corpus.image_ids, "c1"), SETTINGS)
    manifest = json.loads((tmp_path / "lex" / "manifest.json").read_text())
    (tmp_path / "lex" / "manifest.json").write_text(json.dumps({**manifest, "format_version": 1, "old": True}))
    with pytest.raises(StoreError, match="format version 1 but this code reads 2"):
        LexicalIndex.open(tmp_path / "lex")
    rebuilt = build_lexical(tmp_path / "lex", corpus, FakeCache(corpus.image_ids, "c1"), SETTINGS)
    assert rebuilt.manifest["format_version"] == 2 and "old" not in rebuilt.manifest
