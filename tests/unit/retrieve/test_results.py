"""The public records of a search: made from the pipeline's result with each hit's caption and url, written as the
JSON of `retrieve.py --format json` (the service's answer, key for key), read back equal, and compared by their
answer, not by the times a run measured."""

import dataclasses
import json

from cfir_jax.retrieve import report
from cfir_jax.retrieve.pipeline import RankedImage, Retrieval
from cfir_jax.retrieve.results import Hit, Result

CAPTIONS = {"img1": ("a harbour", "http://x/1.png"), "img2": ("a bridge", "")}


def _pipeline_result() -> Retrieval:
    hits = [RankedImage(1, "img1", 0.8125, 4, ("harbour",)), RankedImage(2, "img2", 0.5, 9, ()),
            RankedImage(3, "img3", 0.25, 1, ("bridge", "harbour"))]
    return Retrieval(hits, ["harbour", "bridge"], ["bridge"], "A harbour.", "a note", 12,
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
    line = report.as_json(Result.of("doc", _pipeline_result(), _describe, 3), 3)
    answer = json.loads(line)
    assert list(answer) == ["id", "lang", "entities", "unknown_entities", "num_unknown_entities", "summary", "note",
                            "num_candidates", "times_ms", "hits"]
    assert list(answer["hits"][0]) == ["rank", "image_id", "score", "entities", "caption", "url", "duplicates"]
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


def test_captions_are_read_for_the_described_hits_only():
    asked = []
    record = Result.of("doc", _pipeline_result(), lambda i: asked.append(i) or _describe(i), 3, described=1)
    assert asked == ["img1"] and [h.caption for h in record.hits] == ["a harbour", "", ""]
    assert [h.id for h in record.hits] == ["img1", "img2", "img3"]  # the rest kept for a run file


def test_the_package_has_one_result_class_and_one_hit_class():
    """One record of an answer: the pipeline's ranking by cache row is its own (`Retrieval`), never a second
    `Result` / `Hit` that each door converts (issue 52)."""
    import ast
    from pathlib import Path

    import cfir_jax

    found = {"Result": [], "Hit": []}
    for path in Path(cfir_jax.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and node.name in found:
                found[node.name].append(path.name)
    assert found == {"Result": ["results.py"], "Hit": ["results.py"]}
    assert "row" not in {f.name for f in dataclasses.fields(Hit)}  # the cache row stays inside retrieval


def test_a_hit_carries_its_images_own_fields_in_the_json_only_where_it_has_any():
    """`Hit.fields` (date, source, license, tags: docs/filters.md) from the retriever's rows, in a hit's JSON last and
    only where the image has fields, so that an answer of a collection without fields is unchanged."""
    own = {"img1": {"date": "2020-06-12T14:05:30-04:00", "source": "reuters", "tags": ["news", "sport"],
                    "featured": True}}
    record = Result.of("doc", _pipeline_result(), _describe, 3, fields=lambda i: own.get(i, {}))
    assert [h.fields for h in record.hits] == [own["img1"], {}, {}]
    answer = json.loads(report.as_json(record, 3))
    assert list(answer["hits"][0]) == ["rank", "image_id", "score", "entities", "caption", "url", "duplicates",
                                       "fields"]
    assert answer["hits"][0]["fields"] == own["img1"] and "fields" not in answer["hits"][1]
    assert Result.from_json(answer) == record and Result.from_json(answer).hits[0].fields == own["img1"]
    bare = Result.of("doc", _pipeline_result(), _describe, 3)
    assert report.as_json(bare, 3) == report.as_json(dataclasses.replace(record, hits=tuple(
        dataclasses.replace(h, fields={}) for h in record.hits)), 3)
    assert record != bare  # the fields are part of the answer
