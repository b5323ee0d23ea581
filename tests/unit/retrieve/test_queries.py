"""Query documents read safely (cfir_jax/retrieve/queries.py): what a file holds becomes documents with their ids,
each text held to the one rule of a query (cfir_jax/core/query_rule.py), and every kind of bad file is refused in one
line naming the file (and the line), and methods by name."""

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cfir_jax.core.errors import CfirError
from cfir_jax.core.query_rule import check_text
from cfir_jax.retrieve import queries
from cfir_jax.retrieve.methods import METHODS, method_of

LIMIT = 65536  # serve.max_text_bytes


def test_a_query_file_is_its_stripped_text_named_by_its_stem(tmp_path):
    (tmp_path / "harbour.txt").write_text("  The harbour of Ashford.\n\n")
    doc = queries.read_query(tmp_path / "harbour.txt", LIMIT)
    assert (doc.text, doc.doc_id) == ("The harbour of Ashford.", "harbour")
    (tmp_path / "cafe.txt").write_text(" Cafe\u0301 de Flore \f")  # as every door reads a text: NFC, stripped
    assert queries.read_query(tmp_path / "cafe.txt", LIMIT).text == "Caf\u00e9 de Flore"


def test_queries_keep_their_order_and_ids(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ({"id": "b", "text": "two"}, {"id": 7, "text": "one"})) + "\n\n")
    assert [(d.doc_id, d.text) for d in queries.read_queries(path, LIMIT)] == [("b", "two"), ("7", "one")]
    path.write_text(json.dumps({"id": "Zu\u0308rich", "text": "one"}))  # ids are NFC, as the collection's
    assert [d.doc_id for d in queries.read_queries(path, LIMIT)] == ["Z\u00fcrich"]


@pytest.mark.parametrize("content, refusal", [
    (b"", "query file is empty"),
    (b"   \n\t", "query file is empty"),
    (b"abc\x00def", "query file is binary (control character U+0000 at character 3), expected plain text"),
    (b"abc\x1bdef", "query file is binary (control character U+001B at character 3), expected plain text"),
    (b"caf\xe9", "query file is not UTF-8 text (bad byte at offset 3)"),
])
def test_a_bad_query_file_is_one_line(tmp_path, content, refusal):
    path = tmp_path / "doc.txt"
    path.write_bytes(content)
    with pytest.raises(CfirError) as refused:
        queries.read_query(path, LIMIT)
    assert str(refused.value) == f"{path}: {refusal}"


def test_a_missing_or_oversized_query_is_refused(tmp_path, monkeypatch):
    with pytest.raises(CfirError, match="query file not found"):
        queries.read_query(tmp_path / "nope.txt", LIMIT)
    with pytest.raises(CfirError, match="is not a regular file"):
        queries.read_query(tmp_path, LIMIT)
    (tmp_path / "long.txt").write_text("a" * 9)
    with pytest.raises(CfirError, match="query file is 9 bytes, over serve.max_text_bytes=8 "):
        queries.read_query(tmp_path / "long.txt", 8)
    for name, refusal in (("a" * 300, "cannot read the query file (File name too long)"), ("a\x00b", "not found")):
        with pytest.raises(CfirError, match=re.escape(refusal)):  # a name too long, a NUL: one line, no OSError
            queries.read_query(tmp_path / name, LIMIT)


@pytest.mark.parametrize("lines, refusal", [
    (['{"id": "a", "text": "x"}', "{not json"], r"q.jsonl:2: not a JSON object"),
    (['{"text": "x"}'], r"q.jsonl:1: expected"),
    (['{"id": "a b", "text": "x"}'], "has whitespace"),
    (['{"id": "a", "text": "x"}', '{"id": "a", "text": "y"}'], r"q.jsonl:2: duplicate id 'a'"),
    (['{"id": "a", "text": "  "}'], "q.jsonl:1: text of id 'a' is empty"),
    (['{"id": "a", "text": "x\\u0007y"}'], "q.jsonl:1: text of id 'a' is binary (control character U+0007"),
    (['{"id": "a", "text": "' + "x" * 9 + '"}'], "q.jsonl:1: text of id 'a' is 9 bytes, over serve.max_text_bytes=8"),
    (["", " "], "no queries"),
])
def test_a_bad_queries_file_names_its_line(tmp_path, lines, refusal):
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(lines))
    with pytest.raises(CfirError, match=re.escape(refusal)):
        queries.read_queries(path, 8)


def test_methods_by_name_say_what_they_read():
    class Settings:
        text = "summary"

    assert set(METHODS) == {"cfir", "dense_document", "dense_summary", "entity_only", "bm25", "cfir_bm25",
                            "cfir_bm25_fused", "cfir_bm25_convex", "cfir_text_convex"}
    assert method_of("cfir", Settings).uses_entities and method_of("cfir", Settings).uses_summary()
    assert method_of("dense_document", Settings).reads_document() and not method_of("dense_document", Settings)\
        .uses_entities
    assert not method_of("entity_only", Settings).uses_summary()
    assert method_of("bm25", Settings).uses_lexical and not method_of("bm25", Settings).uses_entities
    assert method_of("cfir_bm25", Settings).uses_lexical and method_of("cfir_bm25", Settings).uses_entities
    assert not method_of("cfir", Settings).uses_lexical
    with pytest.raises(CfirError, match="unknown method 'bm26': use one of cfir, dense_document"):
        method_of("bm26", Settings)


@settings(max_examples=100, deadline=None, database=None)
@given(content=st.one_of(st.binary(max_size=200),
                         st.text(max_size=100).map(lambda t: t.encode("utf-8", "surrogatepass"))))
def test_fuzz_any_query_file_is_a_document_or_one_line(tmp_path_factory, content):
    """The command's door (`retrieve.py --query FILE`): whatever a file holds, a document held to the rule, or one
    CfirError line naming the file."""
    path = tmp_path_factory.mktemp("q") / "doc.txt"
    path.write_bytes(content)
    try:
        doc = queries.read_query(path, 64)
    except CfirError as refused:
        assert str(refused).startswith(f"{path}: ") and "\n" not in str(refused)
    else:
        assert doc.text == check_text(content.decode("utf-8"), "text", 64) and doc.doc_id == "doc"
