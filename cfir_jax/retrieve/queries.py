"""Reading query documents safely: one document (`--query doc.txt`) or many (`--queries docs.jsonl`)."""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from pathlib import Path

from cfir_jax.core.errors import CfirError
from cfir_jax.core.jsonl import json_objects
from cfir_jax.retrieve.pipeline import DocumentInput

# A document is a few KB (a Wikipedia section); 256 KiB is ~40,000 words. spaCy parses ~10k words/s on one core, so
# at 1 MiB a query took 26 s (and 3.3 GB before entities were parsed in segments): not a document, and not a query.
MAX_QUERY_BYTES = 256 << 10
MAX_QUERIES_BYTES = 1 << 30


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def read_bounded(path: str | Path, what: str, limit: int, too_large: Callable[[int], str],
                 error: type[CfirError] = CfirError) -> bytes:
    """The bytes of a file a user named (`what`: "query file", "picture"), refused in one line (`error`) when
    missing, not a regular file, empty, or over `limit` bytes (`too_large(size)`: what the refusal says after
    "is")."""
    path = Path(path)
    if not path.exists():
        raise error(f"{path}: {what} not found")
    if not path.is_file():
        raise error(f"{path}: {what} is not a regular file")
    size = path.stat().st_size
    if size == 0:
        raise error(f"{path}: {what} is empty")
    if size > limit:
        raise error(f"{path}: {what} is {too_large(size)}")
    return path.read_bytes()


def _read_text(path: str | Path, limit: int, what: str) -> str:
    data = read_bounded(path, what, limit,
                        lambda size: f"{_size(size)}, over the {_size(limit)} limit (is it really a document?)")
    if b"\x00" in data:
        raise CfirError(f"{path}: {what} is binary (NUL bytes), expected UTF-8 text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CfirError(f"{path}: {what} is not UTF-8 text (bad byte at offset {e.start})") from None
    if not text.strip():
        raise CfirError(f"{path}: {what} holds only whitespace")
    return text


def read_query(path: str | Path) -> DocumentInput:
    """A plain-text document file."""
    doc_id = unicodedata.normalize("NFC", Path(path).stem) or "query"
    return DocumentInput(_read_text(path, MAX_QUERY_BYTES, "query file").strip(), doc_id=doc_id)


def read_queries(path: str | Path) -> list[DocumentInput]:
    """JSON lines {"id": ..., "text": ...}; ids unique, no whitespace (they become TREC topic ids)."""
    text = _read_text(path, MAX_QUERIES_BYTES, "queries file")
    docs, seen = [], set()
    for where, record in json_objects(path, text.split("\n")):
        if not isinstance(record.get("text"), str) or "id" not in record:
            raise CfirError(f'{where}: expected {{"id": ..., "text": "..."}}')
        doc_id = unicodedata.normalize("NFC", str(record["id"]))  # as the collection's ids (cfir_jax.data.files)
        if not doc_id or any(c.isspace() for c in doc_id):
            raise CfirError(f"{where}: id {doc_id!r} is empty or has whitespace (TREC topic ids cannot)")
        if doc_id in seen:
            raise CfirError(f"{where}: duplicate id {doc_id!r}")
        if not record["text"].strip():
            raise CfirError(f"{where}: empty text for id {doc_id!r}")
        seen.add(doc_id)
        docs.append(DocumentInput(record["text"], doc_id))
    if not docs:
        raise CfirError(f"{path}: no queries")
    return docs
