"""The public records of a search: made from the pipeline's result with each hit's caption and url, written as the
JSON of `retrieve.py --format json` (the service's answer, key for key), read back equal, and compared by their
answer, not by the times a run measured."""

import json

from cfir_jax.retrieve import report
from cfir_jax.retrieve.pipeline import Hit as PipelineHit
from cfir_jax.retrieve.pipeline import Result as PipelineResult
from cfir_jax.retrieve.results import Hit, Result

CAPTIONS = {"img1": ("a harbour", "http://x/1.png"), "img2": ("a bridge", "")}


def _pipeline_result() -> PipelineResult:
    hits = [PipelineHit(1, "img1", 0.8125, 4, ("harbour",)), PipelineHit(2, "img2", 0.5, 9, ()),
            PipelineHit(3, "img3", 0.25, 1, ("bridge", "harbour"))]
    return PipelineResult(hits, ["harbour", "bridge"], ["bridge"], "A harbour.", "a note", 12,
                          {"entities": 1.5, "er": 0.25})


def _describe(image_id: str) -> tuple[str, str]:
    return CAPTIONS.get(image_id, ("", ""))


def test_the_record_of_a_pipeline_result_holds_its_first_hits_with_captions():
    record = Result.of("doc", _pipeline_result(), _describe, 2)
    assert record.hits == (Hit(1, "img1", 0.8125, "a harbour", "http://x/1.png", ("harbour",)),
                           Hit(2, "img2", 0.5, "a bridge", "", ()))
    assert (record.id, record.entities, record.unknown_entities, record.summary, record.note) == \
        ("doc", ("harbour", "bridge"), ("bridge",), "A harbour.", "a note")
    assert record.num_candidates == 12 and record.times_ms == {"entities": 1.5, "er": 0.25}


def test_as_json_is_the_records_json_in_the_documented_order():
    line = report.as_json("doc", _pipeline_result(), _describe, 3)
    answer = json.loads(line)
    assert list(answer) == ["id", "lang", "entities", "unknown_entities", "num_unknown_entities", "summary", "note",
                            "num_candidates", "times_ms", "hits"]
    assert list(answer["hits"][0]) == ["rank", "image_id", "score", "entities", "caption", "url"]
    assert answer["num_unknown_entities"] == 1 and answer["hits"][2]["entities"] == ["bridge", "harbour"]
    assert Result.from_json(answer) == Result.of("doc", _pipeline_result(), _describe, 3)


def test_records_compare_by_their_answer_not_their_times():
    record = Result.of("doc", _pipeline_result(), _describe, 3)
    again = Result.from_json(json.loads(json.dumps(record.to_json())) | {"times_ms": {"er": 9.0}})
    assert again == record and again.times_ms == {"er": 9.0}
    moved = Result.from_json(record.to_json() | {"num_candidates": 13})
    assert moved != record


def test_the_version_that_answered_is_carried_but_not_compared():
    record = Result.of("doc", _pipeline_result(), _describe, 3, version=4)
    assert record.version == 4 and "version" not in record.to_json()  # the service sends it as X-Index-Version
    again = Result.from_json(record.to_json(), version=5)
    assert again == record and again.version == 5 and Result.from_json(record.to_json()).version is None
