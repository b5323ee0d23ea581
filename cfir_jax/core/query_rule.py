"""The one rule for a query, at every door: the commands (`--query`, `--queries`), the library (`Index.search`), the
service on both engines (`POST /v1/search`, `/batch`, `/html`, `/image`'s `top_k`) and the client's own checks before
it sends. docs/retrieval.md ("A query's text: one rule at every door") states it for users.

A text is a `str` of at most `limit` bytes of UTF-8 as given (`serve.max_text_bytes`; past it 413), valid Unicode
(no lone surrogate: JSON can carry one, UTF-8 cannot), with no control character but whitespace (tab, line feed,
vertical tab, form feed, carriage return: NUL, the other C0 controls and DEL make it binary). It is used in its NFC
form with the whitespace around it removed, and what is left must not be empty. `top_k` is an `int` (not a bool)
from 1 to the index's `retrieval.top_k`. A query's `id`, echoed in its answer, is a `str` of valid Unicode. Its `lang`,
where stated, is a language code ("fr", "fr-CA": its primary subtag, lower case, is used; docs/languages.md). Every
refusal is a `QueryRefused`: one line and the HTTP status the service answers with it.
"""

from __future__ import annotations

import re
import unicodedata

from cfir_jax.core.errors import CfirError

__all__ = ["QUERY_KINDS", "QueryRefused", "check_id", "check_lang", "check_text", "check_top_k"]

# What a search takes, one of: the refusal of `Index.search` and `Client.search` given none or several.
QUERY_KINDS = "give one of text= (a document), image= (a picture's bytes or file) or image_id= (an indexed picture)"

_SURROGATE = re.compile("[\ud800-\udfff]")
_BINARY = re.compile("[\x00-\x08\x0e-\x1f\x7f]")  # C0 controls but \t \n \v \f \r, and DEL
_LANG = re.compile(r"[A-Za-z]{2,3}(?:[-_][A-Za-z0-9]{1,8})*")  # BCP 47's shape: a primary subtag, then any


class QueryRefused(CfirError):
    """A query the rule refuses: its one-line reason, and the HTTP status a service answers with (413 or 422)."""

    def __init__(self, reason: str, status: int = 422):
        super().__init__(reason)
        self.status = status


def check_text(text: object, what: str = "text", limit: int | None = None) -> str:
    """The text a query is searched with (NFC, stripped), or QueryRefused naming `what` ("text",
    "documents.3.text", "doc.txt: query file"). limit: the most UTF-8 bytes (serve.max_text_bytes); None: unbounded
    (the client's check: the service it asks knows its own limit)."""
    if not isinstance(text, str):
        raise QueryRefused(f"{what} is {type(text).__name__}, expected text (str)")
    if limit is not None and len(text) > limit // 4:  # fewer characters than limit / 4 cannot pass it
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > limit:
            raise QueryRefused(f"{what} is {size:,} bytes, over serve.max_text_bytes={limit:,}", 413)
    _valid_unicode(text, what)
    bad = _BINARY.search(text)
    if bad is not None:
        raise QueryRefused(f"{what} is binary (control character U+{ord(bad.group()):04X} at character "
                           f"{bad.start():,}), expected plain text")
    text = unicodedata.normalize("NFC", text).strip()
    if not text:
        raise QueryRefused(f"{what} is empty")
    return text


def check_id(doc_id: object, what: str = "id") -> str:
    """A query's id as its answer echoes it: a str of valid Unicode (a lone surrogate cannot be written as UTF-8)."""
    if not isinstance(doc_id, str):
        raise QueryRefused(f"{what} is {type(doc_id).__name__}, expected text (str)")
    _valid_unicode(doc_id, what)
    return doc_id


def check_lang(lang: object, what: str = "lang") -> str | None:
    """A stated language as its primary subtag, lower case ("fr-CA" -> "fr"); None where none is stated."""
    if lang is None:
        return None
    if not isinstance(lang, str) or not _LANG.fullmatch(lang.strip()):
        raise QueryRefused(f"{what}: lang {_short(lang)} is not a language code (ISO 639-1 such as 'en', 'fr', 'id')")
    return re.split(r"[-_]", lang.strip())[0].lower()


def _valid_unicode(text: str, what: str) -> None:
    bad = _SURROGATE.search(text)
    if bad is not None:
        raise QueryRefused(f"{what} is not valid Unicode (a lone surrogate, U+{ord(bad.group()):04X}, at character "
                           f"{bad.start():,})")


def check_top_k(top_k: object, max_top_k: int | None = None) -> int:
    """top_k, or QueryRefused: not an int (a bool is not one), or outside 1 .. max_top_k (retrieval.top_k). None:
    the type alone (the client's check: the service knows its index's retrieval.top_k)."""
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise QueryRefused(f"top_k={_short(top_k)}: an integer")
    if max_top_k is not None and not 1 <= top_k <= max_top_k:
        raise QueryRefused(f"top_k={_short(top_k)} out of range: 1 .. {max_top_k}")
    return top_k


def _short(value: object) -> str:
    """A value as a refusal names it: repr, cut to 40 characters (a huge number or string is named, not echoed)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**40:  # str() refuses > 4,300 digits
        return f"a number of about {int(value.bit_length() * 0.30103) + 1:,} digits"
    shown = repr(value)
    return shown if len(shown) <= 40 else shown[:37] + "..."
