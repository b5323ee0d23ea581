"""index.entities.sources (issue 29): a document's entities from spaCy (the paper's text), spaCy plus its section's
category names (the paper's Figure 7), or the category names alone; built into the entity store and indexed from the
training documents like any other entity."""

from __future__ import annotations

import hashlib

import ml_collections
import numpy as np
import pytest

from cfir_jax.builders import entities, entity_index_update
from cfir_jax.builders.entities import entity_key
from cfir_jax.core.errors import CfirError
from cfir_jax.data.synthetic import SyntheticConfig, generate
from cfir_jax.nlp.entity_sources import SourcedExtractor, categories_of, manifest_sources, merged
from cfir_jax.stores.entities import EntityStore
from cfir_jax.stores.layout import Layout


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("world") / "corpus", SyntheticConfig.tiny())


def _config(sources: str) -> ml_collections.ConfigDict:
    from configs.demo import get_config

    config = get_config("tiny")
    config.index.entities.sources = sources
    return config


class _Spacy:
    """A stand-in spaCy extractor: the capitalised words of each text."""

    settings = {"spacy_model": "fake", "labels": ["X"], "entity_format": 2}

    def extract(self, texts):
        return ([w.strip(".,") for w in t.split() if w[:1].isupper()] for t in texts)


def test_merged_keeps_spacys_entities_first_and_the_categories_unique_by_key():
    assert merged(["New York City", "Searchlights"], ["Annual events in New York City", "searchlights", " "]) == \
        ["New York City", "Searchlights", "Annual events in New York City"]
    docs = [("Alpha met Beta.", ("Towns of Alpha", "Alpha")), ("nothing here", ())]

    def extract(sources):
        extractor = SourcedExtractor(_Spacy(), sources)
        return list(extractor.extract([extractor.item(text, cats) for text, cats in docs]))

    assert SourcedExtractor(_Spacy(), "spacy").item("Alpha met Beta.", ("Towns",)) == "Alpha met Beta."
    assert extract("spacy") == [["Alpha", "Beta"], []]
    assert extract("spacy+categories") == [["Alpha", "Beta", "Towns of Alpha"], []]
    assert extract("categories") == [["Towns of Alpha", "Alpha"], []]
    assert "sources" not in SourcedExtractor(_Spacy(), "spacy").settings  # a store of before the choice is "spacy"
    assert SourcedExtractor(_Spacy(), "categories").settings["sources"] == "categories"
    with pytest.raises(CfirError, match="index.entities.sources='wikidata': use one of spacy, spacy"):
        SourcedExtractor(_Spacy(), "wikidata")


def test_category_entities_are_built_per_document_and_indexed_from_the_train_documents(corpus, tmp_path,
                                                                                       monkeypatch):
    layout = Layout.of(tmp_path)
    spacy_store = entities.build_entities(_config("spacy"), layout, corpus)
    assert manifest_sources(spacy_store.manifest) == "spacy"
    plain = [spacy_store.entities_of(i) for i in range(corpus.num_documents)]
    both = entities.build_entities(_config("spacy+categories"), layout, corpus)  # a changed choice rebuilds
    assert both.manifest["sources"] == "spacy+categories"
    only = EntityStore.open(layout.entities)
    for i in range(corpus.num_documents):
        cats = categories_of(corpus.document(i))
        assert cats and both.entities_of(i) == merged(plain[i], cats)
    cats_store = entities.build_entities(_config("categories"), layout, corpus)
    assert [cats_store.entities_of(i) for i in range(corpus.num_documents)] == \
        [merged((), categories_of(corpus.document(i))) for i in range(corpus.num_documents)]
    assert only.manifest["sources"] == "spacy+categories"  # the store opened before is the one it was

    # Indexed from the train documents: every train document's category names are entities of the index, encoded
    # like the others (here by a stand-in encoder), and a test document's own category is unknown there.
    config = _config("spacy+categories")
    both = entities.build_entities(config, layout, corpus)
    dim = 8

    def encode(texts):
        rows = [np.frombuffer(hashlib.sha256(t.encode()).digest()[:dim], np.uint8) for t in texts]
        return np.asarray(rows, np.float32) / 255.0

    monkeypatch.setattr(entity_index_update, "entity_encoder",
                        lambda config, layout, corpus: (type("E", (), {"encode": staticmethod(encode)}), "fp"))
    monkeypatch.setattr(entity_index_update, "check_cache_encoder", lambda config, layout, cache: None)
    cache = ml_collections.ConfigDict(dict(embeddings=np.random.default_rng(0).standard_normal((60, dim))
                                           .astype(np.float32), content_fingerprint="c"))
    config.index.entity_index.update(k=5, backend="exact")
    index = entity_index_update.build_entity_index(config, layout, corpus, both, cache)
    train, test = corpus.qrels("train"), corpus.qrels("test")
    row_of = {d: i for i, d in enumerate(corpus.doc_ids)}
    train_cats = {entity_key(c) for d in train for c in categories_of(corpus.document(row_of[d]))}
    assert train_cats and all(index.row(c) is not None for c in train_cats)
    text = next(c for c in train_cats)
    np.testing.assert_allclose(index.candidates([index.row(text)])[0],
                               np.argsort(-(cache.embeddings @ encode([index.vocab[index.row(text)]])[0]))[:5])
    unseen = {entity_key(c) for d in test for c in categories_of(corpus.document(row_of[d]))} - train_cats
    assert unseen and all(index.row(c) is None for c in unseen)


def test_categories_asked_of_a_corpus_without_them_is_one_line(tmp_path):
    from cfir_jax.data.corpus import Document, Image
    from cfir_jax.data.corpus_writer import write_corpus

    docs = [Document(f"d{i}", f"Alpha met Beta in town {i}.") for i in range(3)]
    corpus = write_corpus(tmp_path / "c", "plain", docs, [Image("i0", caption="an image")],
                          {"train": {"d0": {"i0": 1}}})
    with pytest.raises(CfirError, match="carry no category names") as e:
        entities.build_entities(_config("spacy+categories"), Layout.of(tmp_path / "W"), corpus)
    assert "\n" not in str(e.value)
