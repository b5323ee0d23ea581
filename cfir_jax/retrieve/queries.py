"""Reading query documents safely: one document (`--query doc.txt`) or many (`--queries docs.jsonl`), each text held
to the one rule of a query (`cfir_jax.core.query_rule`: size, Unicode, control characters, NFC) that every door
applies."""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from pathlib import Path

from cfir_jax.core.errors import CfirError
from cfir_jax.core.jsonl import json_objects
from cfir_jax.core.query_rule import check_lang, check_text
from cfir_jax.retrieve.pipeline import DocumentInput

# A document is a few KB (a Wikipedia section); a query's text is at most serve.max_text_bytes (64 KiB, ~10,000
# words) at every door. spaCy parses ~10k words/s on one core: at 1 MiB a query took 26 s (and 3.3 GB before
# entities were parsed in segments). A file of many queries is bounded as a whole, and each of its texts by the rule.
MAX_QUERIES_BYTES = 1 << 30


def read_bounded(path: str | Path, what: str, limit: int, too_large: Callable[[int], str],
                 error: type[CfirError] = CfirError) -> bytes:
    """The bytes of a file a user named (`what`: "query file", "image"), refused in one line (`error`) when
    missing, not a regular file, empty, or over `limit` bytes (`too_large(size)`: what the refusal says after
    "is")."""
    path = Path(path)
    try:
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
    except (OSError, ValueError) as e:  # a name too long, a NUL in it, unreadable: one line, never a traceback
        reason = getattr(e, "strerror", None) or str(e) or type(e).__name__
        raise error(f"{str(path)[:200]}: cannot read the {what} ({reason})") from None


def _read_text(path: str | Path, limit: int, what: str, over: str) -> str:
    data = read_bounded(path, what, limit, lambda size: f"{size:,} bytes, {over}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CfirError(f"{path}: {what} is not UTF-8 text (bad byte at offset {e.start})") from None


def read_documents(path: str | Path, limit: int, *, jsonl: bool = False, lang: str | None = None
                   ) -> list[DocumentInput]:
    """The documents of a file, each text held to the rule (at most `limit` bytes, serve.max_text_bytes): one
    plain-text document, its id the file's stem (`--query doc.txt`), or, with `jsonl`, JSON lines {"id": ...,
    "text": ..., "lang": ...} whose ids are unique and free of whitespace, as TREC topic ids must be (`--queries
    docs.jsonl`); `lang`: the language of a document that states none (`--lang`; None: found, docs/languages.md)."""
    if jsonl:
        text = _read_text(path, MAX_QUERIES_BYTES, "queries file",
                          f"over the {MAX_QUERIES_BYTES:,} a queries file holds")
        records = _records(path, text)
    else:
        text = _read_text(path, limit, "query file", f"over serve.max_text_bytes={limit:,} (is it really a document?)")
        records = [(f"{path}: query file", unicodedata.normalize("NFC", Path(path).stem) or "query", text, None)]
    lang = check_lang(lang, "--lang")
    return [DocumentInput(check_text(text, where, limit), doc_id, lang=stated or lang)
            for where, doc_id, text, stated in records]


def read_query(path: str | Path, limit: int, lang: str | None = None) -> DocumentInput:
    """A plain-text document file of at most `limit` bytes (serve.max_text_bytes), its text held to the rule."""
    return read_documents(path, limit, lang=lang)[0]


def read_queries(path: str | Path, limit: int, lang: str | None = None) -> list[DocumentInput]:
    """JSON lines {"id": ..., "text": ..., "lang": ...}; ids unique, no whitespace (they become TREC topic ids); each
    text held to the rule, at most `limit` bytes (serve.max_text_bytes)."""
    return read_documents(path, limit, jsonl=True, lang=lang)


def _records(path: str | Path, text: str) -> list[tuple[str, str, str, str | None]]:
    """(where, id, text, stated language) of each JSON line of a queries file, its id and language checked; its text
    is checked by the caller."""
    records, seen = [], set()
    for where, record in json_objects(path, text.split("\n")):
        if not isinstance(record.get("text"), str) or "id" not in record:
            raise CfirError(f'{where}: expected {{"id": ..., "text": "..."}}')
        doc_id = unicodedata.normalize("NFC", str(record["id"]))  # as the collection's ids (cfir_jax.data.files)
        if not doc_id or any(c.isspace() for c in doc_id):
            raise CfirError(f"{where}: id {doc_id!r} is empty or has whitespace (TREC topic ids cannot)")
        if doc_id in seen:
            raise CfirError(f"{where}: duplicate id {doc_id!r}")
        seen.add(doc_id)
        records.append((f"{where}: text of id {doc_id!r}", doc_id, record["text"],
                        check_lang(record.get("lang"), f"{where}: id {doc_id!r}")))
    if not records:
        raise CfirError(f"{path}: no queries")
    return records
