"""Query documents read safely (cfir_jax/retrieve/queries.py): what a file holds becomes documents with their ids,
and every kind of bad file is refused in one line naming the file (and the line), and methods by name."""

import json

import pytest

from cfir_jax.core.errors import CfirError
from cfir_jax.retrieve import queries
from cfir_jax.retrieve.methods import METHODS, method_of


def test_a_query_file_is_its_stripped_text_named_by_its_stem(tmp_path):
    (tmp_path / "harbour.txt").write_text("  The harbour of Ashford.\n\n")
    doc = queries.read_query(tmp_path / "harbour.txt")
    assert (doc.text, doc.doc_id) == ("The harbour of Ashford.", "harbour")


def test_queries_keep_their_order_and_ids(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ({"id": "b", "text": "two"}, {"id": 7, "text": "one"})) + "\n\n")
    assert [(d.doc_id, d.text) for d in queries.read_queries(path)] == [("b", "two"), ("7", "one")]
    path.write_text(json.dumps({"id": "Zu\u0308rich", "text": "one"}))  # ids are NFC, as the collection's
    assert [d.doc_id for d in queries.read_queries(path)] == ["Z\u00fcrich"]


@pytest.mark.parametrize("content, refusal", [
    (b"", "is empty"),
    (b"   \n\t", "holds only whitespace"),
    (b"abc\x00def", "is binary"),
    (b"caf\xe9", "is not UTF-8 text (bad byte at offset 3)"),
])
def test_a_bad_query_file_is_one_line(tmp_path, content, refusal):
    path = tmp_path / "doc.txt"
    path.write_bytes(content)
    with pytest.raises(CfirError, match=refusal.replace("(", r"\(").replace(")", r"\)")):
        queries.read_query(path)


def test_a_missing_or_oversized_query_is_refused(tmp_path, monkeypatch):
    with pytest.raises(CfirError, match="query file not found"):
        queries.read_query(tmp_path / "nope.txt")
    with pytest.raises(CfirError, match="is not a regular file"):
        queries.read_query(tmp_path)
    monkeypatch.setattr(queries, "MAX_QUERY_BYTES", 8)
    (tmp_path / "long.txt").write_text("a" * 9)
    with pytest.raises(CfirError, match="over the 0 KiB limit"):
        queries.read_query(tmp_path / "long.txt")


@pytest.mark.parametrize("lines, refusal", [
    (['{"id": "a", "text": "x"}', "{not json"], r"q.jsonl:2: not a JSON object"),
    (['{"text": "x"}'], r"q.jsonl:1: expected"),
    (['{"id": "a b", "text": "x"}'], "has whitespace"),
    (['{"id": "a", "text": "x"}', '{"id": "a", "text": "y"}'], r"q.jsonl:2: duplicate id 'a'"),
    (['{"id": "a", "text": "  "}'], "empty text for id 'a'"),
    (["", " "], "holds only whitespace"),
])
def test_a_bad_queries_file_names_its_line(tmp_path, lines, refusal):
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(lines))
    with pytest.raises(CfirError, match=refusal):
        queries.read_queries(path)


def test_methods_by_name_say_what_they_read():
    class Settings:
        text = "summary"

    assert set(METHODS) == {"cfir", "dense_document", "dense_summary", "entity_only", "bm25", "cfir_bm25",
                            "cfir_bm25_fused"}
    assert method_of("cfir", Settings).uses_entities and method_of("cfir", Settings).uses_summary()
    assert method_of("dense_document", Settings).reads_document() and not method_of("dense_document", Settings)\
        .uses_entities
    assert not method_of("entity_only", Settings).uses_summary()
    assert method_of("bm25", Settings).uses_lexical and not method_of("bm25", Settings).uses_entities
    assert method_of("cfir_bm25", Settings).uses_lexical and method_of("cfir_bm25", Settings).uses_entities
    assert not method_of("cfir", Settings).uses_lexical
    with pytest.raises(CfirError, match="unknown method 'bm26': use one of cfir, dense_document"):
        method_of("bm26", Settings)
