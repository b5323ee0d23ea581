"""Entities matched against image-side text: the matcher against a regex oracle, the store, and retrieval with it."""

import re

import numpy as np
import pytest

from cfir_jax.builders.entity_text_match import MatchSettings, build_entity_text_match, match_entities, words
from cfir_jax.core.errors import StoreError
from cfir_jax.data.corpus import Document, Image
from cfir_jax.data.corpus_writer import write_corpus
from cfir_jax.stores.entity_text_match import EntityTextMatch


def oracle(names, text, max_words=8):
    """Whole-word, case-folded containment by regex: the definition the hash-map matcher must equal."""
    folded = " ".join(words(text))
    out = []
    for i, name in enumerate(names):
        w = words(name)
        if 0 < len(w) <= max_words and re.search(rf"(?<!\S){re.escape(' '.join(w))}(?!\S)", folded):
            out.append(i)
    return out


def test_matches_whole_words_case_folded():
    names = ["The Hague", "Hague", "McDonald's", "New York", "York", "Saint-Denis", "a b c d e f g h i"]
    texts = ["Painted in THE HAGUE, 1890", "Hagueville town hall", "McDonald\u2019s in New York city",
             "Saint-Denis basilica; saint denis", "Yorkshire pudding", "a b c d e f g h i", ""]
    got = match_entities(names, texts, max_words=8)
    assert got == [[0, 1], [], [2, 3, 4], [5], [], [], []]
    assert got == [oracle(names, t) for t in texts]


def test_matcher_equals_the_regex_oracle_on_random_texts():
    rng = np.random.default_rng(0)
    vocab = ["anna", "berg", "city", "dale", "eve", "fox", "gate", "hill"]
    names = sorted({" ".join(rng.choice(vocab, rng.integers(1, 4))) for _ in range(40)})
    names += [n.title() for n in names[:5]]  # the same names in other case: both match
    texts = [" ".join(rng.choice(vocab + ["x", "y,", "z."], rng.integers(0, 25))) for _ in range(200)]
    got = match_entities(names, texts, max_words=3)
    assert got == [oracle(names, t, max_words=3) for t in texts]
    assert sum(map(len, got)) > 200  # the texts do mention the names: the comparison is not vacuous


class FakeIndex:
    """The two things the builder reads of an EntityIndex."""

    def __init__(self, vocab):
        self.vocab, self.manifest = vocab, {"built": "now", "vocab": vocab}

    def __len__(self):
        return len(self.vocab)


class FakeCache:
    def __init__(self, ids):
        self.ids, self.num_images, self.content_fingerprint = ids, len(ids), "cache-1"


@pytest.fixture
def small(tmp_path):
    field = "caption_reference_description"
    texts = {"i0": "Anna Berg at the gate", "i1": "Photograph by anna berg", "i2": "", "i3": "London bridge",
             "i4": "London", "i5": "A view of London"}
    images = [Image(i, texts={field: (t,)} if t else {}) for i, t in texts.items()]
    corpus = write_corpus(tmp_path / "corpus", "t", [Document("d0", "x")], images, {})
    return corpus, FakeCache(["i5", "i4", "i3", "i2", "i1", "i0"]), FakeIndex(["Anna Berg", "London", "Paris"])


def test_store_lists_cache_rows_and_leaves_out_too_common_names(small, tmp_path):
    corpus, cache, index = small
    store = build_entity_text_match(tmp_path / "m", corpus, cache, index, MatchSettings(max_matches=2, chunk_rows=4))
    anna, london, paris = store.rows_of([0, 1, 2])
    assert anna.tolist() == [4, 5]  # cache rows of i1 and i0, ascending, across two chunks
    assert london.tolist() == [] and paris.tolist() == []  # London is in 3 > 2 images' text
    assert store.manifest["too_common"] == 1 and store.manifest["num_pairs"] == 2
    wide = build_entity_text_match(tmp_path / "w", corpus, cache, index, MatchSettings(max_matches=3))
    assert wide.rows_of([1])[0].tolist() == [0, 1, 2]


def test_store_from_another_entity_index_is_refused_then_rebuilt(small, tmp_path):
    corpus, cache, index = small
    build_entity_text_match(tmp_path / "m", corpus, cache, index)
    other = FakeIndex(["Anna Berg", "London", "Paris", "Rome"])
    from cfir_jax.stores.contract import manifest_digest

    with pytest.raises(StoreError, match="stale, built for entity_index="):
        EntityTextMatch.open(tmp_path / "m", entity_index=manifest_digest(other.manifest))
    rebuilt = build_entity_text_match(tmp_path / "m", corpus, cache, other)
    assert len(rebuilt) == 4


def test_interrupted_build_resumes_without_redoing_finished_chunks(small, tmp_path, monkeypatch):
    import cfir_jax.builders.entity_text_match as etm

    corpus, cache, index = small
    calls = []
    real = etm.match_entities

    def failing_second(names, texts, max_words=8):
        calls.append(len(texts))
        if len(calls) == 2:
            raise KeyboardInterrupt  # the build dies in its second chunk
        return real(names, texts, max_words)

    monkeypatch.setattr(etm, "match_entities", failing_second)
    with pytest.raises(KeyboardInterrupt):
        build_entity_text_match(tmp_path / "m", corpus, cache, index, MatchSettings(max_matches=2, chunk_rows=4))
    assert not (tmp_path / "m").exists()  # nothing half-written is published
    calls.clear()
    monkeypatch.setattr(etm, "match_entities", lambda *a, **k: (calls.append(len(a[1])), real(*a, **k))[1])
    store = build_entity_text_match(tmp_path / "m", corpus, cache, index, MatchSettings(max_matches=2, chunk_rows=4))
    assert calls == [2]  # only the second chunk (rows 4-5) was matched again
    assert store.rows_of([0])[0].tolist() == [4, 5]
    assert not (tmp_path / ".m.building").exists()
