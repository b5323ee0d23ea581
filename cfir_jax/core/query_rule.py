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

The value a query travels as: the `Query` record and its filter's typed `Condition`s. Each door makes one `Query`
where the user's words arrive (the command's flags, the library's arguments, the HTTP body, the client's call, the
page's form) and carries it unchanged to `cfir_jax.api.index.Index`. Its filter is a tuple of `Condition`s (field,
op, values), joined by AND (docs/filters.md):

- a LINE a person typed (`--where 'license in cc-by,cc0'`, the page's box, a string in HTTP's or the library's
  `where`) is parsed once, at its door, by `parse_line`: `FIELD OP VALUE` with OP one of `= != < <= > >=`, or
  `FIELD in V1,V2,...`; a value may be quoted ('a b'), and the spaces around each value are dropped;
- a triple `(field, op, value)` or `(field, "in", [values])` is taken as it is: its values verbatim (commas, spaces,
  quotes, any Unicode kept), never written out as a line and read again;
- between processes a condition is JSON, `["license", "in", ["a,b", "c"]]` (`Condition.to_json`), which the service
  reads back as the same triple. So `Index.search`, `Client.search`, HTTP and `retrieve.py --where` give one meaning.

A filter's size is bounded (`FilterLimits`: conditions, values per condition, UTF-8 bytes of all its fields and
values: the config's serve.max_filter_*), refused in one line (413). Whether its fields exist and its values have
their field's type is the index's to say (`Index.check`), before the query joins a batch. The rule and the record
are one module: a query's trip through the floor is one stay (tests/unit/commands/test_query_trace.py). No JAX, no
numpy: the client imports this module.
"""

from __future__ import annotations

import dataclasses
import os
import re
import unicodedata
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cfir_jax.core.errors import CfirError

__all__ = ["OPS", "QUERY_KINDS", "Condition", "FilterError", "FilterLimits", "Query", "QueryRefused", "check_id",
           "check_facets", "check_lang", "check_text", "check_top_k", "conditions", "parse", "parse_line"]

# What a search takes, one of: the refusal of `Index.search` and `Client.search` given none or several.
QUERY_KINDS = "give one of text= (a document), image= (an image's bytes or file) or image_id= (an indexed image)"

_SURROGATE = re.compile("[\ud800-\udfff]")
_BINARY = re.compile("[\x00-\x08\x0e-\x1f\x7f]")  # C0 controls but \t \n \v \f \r, and DEL
_CONTROL = re.compile("[\x00-\x1f\x7f\x85\u2028\u2029]")  # what may break a line that names a condition
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


OPS = ("=", "!=", "<", "<=", ">", ">=", "in")
_LINE = re.compile(r"^\s*([^\s=<>!,]+)\s*(?:(<=|>=|!=|=|<|>)|\s(in)\s)\s*(.*?)\s*$", re.S)


class FilterError(QueryRefused):
    """A filter that cannot be read or applied: malformed, an unknown field, a value of the wrong type (a service
    answers 422, 413 for one over its size limits; a command exits 2)."""


@dataclasses.dataclass(frozen=True)
class Condition:
    """One condition: `field op values` (one value, or one or more for `in`), each value a string as given."""

    field: str
    op: str
    values: tuple[str, ...]

    def __str__(self) -> str:
        """The condition as a note or a refusal names it, a line a person reads: a value quoted where a line would
        read it otherwise (`source=' x '`, `license in 'a,b',c`: `_written`), and control characters escaped
        (`a\\nb`), so that a refusal naming a value with a line break stays one line. It is never parsed again;
        without a control character, a comparison's line, or an `in` whose values hold no comma, reads back as this
        condition (`parse_line`)."""
        if self.op == "in":
            return _escaped(f"{self.field} in {','.join(_written(v, listed=True) for v in self.values)}")
        return _escaped(f"{self.field}{self.op}{_written(self.values[0], listed=False)}")

    def to_json(self) -> list:
        """The JSON triple it crosses the wire as: `[field, op, value]`, `[field, "in", [values]]`."""
        return [self.field, self.op, list(self.values) if self.op == "in" else self.values[0]]


@dataclasses.dataclass(frozen=True)
class FilterLimits:
    """The most a filter may hold (the config's serve.max_filter_conditions, max_filter_values, max_filter_bytes)."""

    conditions: int
    values: int  # per condition
    bytes: int  # UTF-8 bytes of every field and value together

    @classmethod
    def of(cls, serve) -> FilterLimits:
        """The limits of a config's serve section."""
        return cls(int(serve.max_filter_conditions), int(serve.max_filter_values), int(serve.max_filter_bytes))

    def read(self, where: Any) -> tuple[Condition, ...]:
        """The conditions of `where` as a door reads them (`conditions`), held to the limits: the count of
        conditions, a line's length and a triple's count of values are held before anything is parsed, so that a
        filter far past them costs no more than its refusal."""
        items = [where] if isinstance(where, (str, Condition)) else where
        if isinstance(items, (list, tuple)):
            if len(items) > self.conditions:
                raise FilterError(f"where: {len(items):,} conditions, over serve.max_filter_conditions="
                                  f"{self.conditions:,}", 413)
            for item in items:
                if isinstance(item, str) and len(item) > self.bytes:  # more characters than bytes allowed
                    raise FilterError(f"where: a filter of {len(item):,} characters, over serve.max_filter_bytes="
                                      f"{self.bytes:,}", 413)
                if isinstance(item, (list, tuple)) and len(item) == 3 and isinstance(item[2], (list, tuple)) \
                        and len(item[2]) > self.values:
                    raise FilterError(f"where: {_name(item[0], 40)} {_name(item[1], 8)} has {len(item[2]):,} values, "
                                      f"over serve.max_filter_values={self.values:,}", 413)
        out = conditions(items)
        self.check(out)
        return out

    def check(self, where: Sequence[Condition]) -> None:
        """Nothing, or FilterError (413) naming the limit the filter passes."""
        if len(where) > self.conditions:
            raise FilterError(f"where: {len(where):,} conditions, over serve.max_filter_conditions="
                              f"{self.conditions:,}", 413)
        size = 0
        for cond in where:
            if len(cond.values) > self.values:
                raise FilterError(f"where: {cond.field} {cond.op} has {len(cond.values):,} values, over "
                                  f"serve.max_filter_values={self.values:,}", 413)
            size += sum(len(v.encode("utf-8")) for v in (cond.field, *cond.values))
        if size > self.bytes:
            raise FilterError(f"where: {size:,} bytes of fields and values, over serve.max_filter_bytes="
                              f"{self.bytes:,}", 413)


def _escaped(text: str) -> str:
    """`text` with its control characters (line breaks, NUL, DEL) written as Python escapes them."""
    return _CONTROL.sub(lambda found: repr(found.group())[1:-1], text)


def _written(value: str, listed: bool) -> str:
    """A value as a line writes it: quoted where a line would read it otherwise (outer spaces or quotes, which a line's
    value loses; a leading '=', which `<` or `>` would take as theirs; a ';', which separates the page's lines; a ','
    in an `in` list, which separates its values)."""
    plain = value == value.strip() and value[:1] not in "'\"=" and value[-1:] not in "'\"" and ";" not in value
    if plain and not (listed and "," in value):
        return value
    quote = '"' if "'" in value and '"' not in value else "'"
    return f"{quote}{value}{quote}"


def _unquote(text: str) -> str:
    text = text.strip()
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"" else text


def _said(expr: object) -> str:
    """A filter as a refusal names it: repr, cut to 80 characters (a 10,000-value line is named, not echoed; one
    holding an int Python does not write, over 4,300 digits, by what it holds)."""
    try:
        shown = repr(expr)
    except ValueError:
        return "(a triple with a number too long to write)"
    return shown if len(shown) <= 80 else shown[:77] + "..."


def _name(part: object, cut: int) -> str:
    """A triple's field or operator as a refusal names it: a str cut to `cut` characters, anything else `_short`."""
    return part[:cut] if isinstance(part, str) else _short(part)


def parse_line(line: str) -> Condition:
    """The condition of a filter line a person typed (`date<=2020-06-30`, `license in cc-by, cc0`)."""
    found = _LINE.match(line)
    if found is None:
        raise FilterError(f"filter {_said(line)}: expected FIELD OP VALUE with OP one of {' '.join(OPS)} "
                          "(e.g. 'date<=2020-06-30', 'license in cc-by,cc0')")
    field, op, is_in, rest = found.groups()
    values = tuple(_unquote(v) for v in rest.split(",")) if is_in else (_unquote(rest),)
    return _checked(field, op or "in", values, _said(line))


def parse(expr: Any) -> Condition:
    """A condition from a line (parsed), a `(field, op, value | [values])` triple (taken as it is: a number is
    written with str(), 100 -> "100", a bool as JSON spells it), or a Condition."""
    if isinstance(expr, Condition):
        return expr
    if isinstance(expr, str):
        return parse_line(expr)
    if isinstance(expr, (tuple, list)) and len(expr) == 3:
        field, op, value = expr
        if not isinstance(field, str) or not isinstance(op, str):
            raise FilterError(f"filter {_said(expr)}: a triple (field, op, value) of a field name and an operator")
        values = tuple(_value(v, expr) for v in value) if isinstance(value, (list, tuple)) else (_value(value, expr),)
        return _checked(field, op, values, _said(tuple(expr)))
    raise FilterError(f"filter {_said(expr)}: give a string such as 'date<=2020-06-30' or a (field, op, value) "
                      "triple")


def _value(value: object, expr: object) -> str:
    """A triple's value as the string its field's type reads: a str as it is, a number with str(), a bool as JSON
    spells it ("true", "false")."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        try:
            return str(value)
        except ValueError:  # an int of over 4,300 digits, which Python does not write: named by its size
            raise FilterError(f"filter {_said(expr)}: a value is {_short(value)}, too long for a number") from None
    raise FilterError(f"filter {_said(expr)}: a value is a string, a number or a bool, not {type(value).__name__}")


def _checked(field: str, op: str, values: tuple[str, ...], said: str) -> Condition:
    if op not in OPS:
        raise FilterError(f"filter {said}: unknown operator {op!r}; use one of {' '.join(OPS)}")
    if not field.strip():
        raise FilterError(f"filter {said}: no field name")
    if not values or any(v == "" for v in values):
        raise FilterError(f"filter {said}: no value")
    if op != "in" and len(values) != 1:
        raise FilterError(f"filter {said}: one value for {op} (several are `in`'s)")
    for text in (field, *values):
        if _SURROGATE.search(text):
            raise FilterError(f"filter {said}: not valid Unicode (a lone surrogate)")
    return Condition(field, op, values)


def check_facets(facets: object) -> tuple[str, ...]:
    """The fields a query counts its ranked images' values of (`facets`: docs/filters.md), each named once, in
    the order given: None or [] -> none; a line "source,tags" or a list of names. Whether each is a field of the
    index, and of a kind it counts, is the index's to say (`Index.check`)."""
    if facets is None:
        return ()
    names = facets.split(",") if isinstance(facets, str) else facets
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise QueryRefused(f"facets: {_short(facets)} is not a list of field names")
    names = [n.strip() for n in names]
    if any(not n or _SURROGATE.search(n) for n in names):
        raise QueryRefused(f"facets: {_short(facets)} holds an empty or invalid field name")
    return tuple(dict.fromkeys(names))


def conditions(where: Sequence[Any] | str | Condition | None) -> tuple[Condition, ...]:
    """The conditions of `where`: None or [] -> none; one line or Condition -> one; else a list of lines, triples
    and Conditions (docs/filters.md)."""
    if where is None:
        return ()
    if isinstance(where, (str, Condition)):
        where = [where]
    if not isinstance(where, (list, tuple)):
        raise FilterError(f"where: {_said(where)} is not a list of filters")
    return tuple(parse(w) for w in where)


@dataclasses.dataclass(frozen=True)
class Query:
    """One query, made once at its door and carried unchanged to the index: a document's `text`, or an image:
    `image` (its bytes, or an image file's path) or `image_id` (an indexed image's id); `id`, echoed in the
    answer (None: the door's default); `method` (None: the index's); `top_k`; `lang` (a text's language, its primary
    subtag; None: found); `where`, the typed conditions; `fold`, near-duplicates folded under each hit shown;
    `facets`, the fields whose values are counted over the images it ranked (docs/filters.md).

    Made from a door's loose values (exactly one of text, image and image_id, then keywords: `where` lines, triples
    or Conditions, parsed here, once; `lang` a language code; `image` a path as str too) and held to the rules every
    door applies without the index (`cfir_jax.core.query_rule`): a Query is checked when it is made, whoever makes
    it. The index's own refusals (top_k's range, a field, a value's type) are `Index.check`'s."""

    text: str | None = None
    _: dataclasses.KW_ONLY
    image: bytes | Path | None = None
    image_id: str | None = None
    id: str | None = None
    method: str | None = None
    top_k: int = 20
    lang: str | None = None
    where: tuple[Condition, ...] = ()
    fold: bool = True
    facets: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.text, self.image, self.image_id)) != 1:
            raise QueryRefused(QUERY_KINDS)
        image = self.image
        if image is not None and not isinstance(image, bytes):
            if isinstance(image, (bytearray, memoryview)):
                image = bytes(image)
            elif isinstance(image, (str, os.PathLike)):
                image = Path(image)
            else:
                raise QueryRefused(f"image: expected an image's bytes or an image file, got {type(image).__name__}")
        if self.image_id is not None and not isinstance(self.image_id, str):
            raise QueryRefused(f"image_id: expected an indexed image's id (str), got {type(self.image_id).__name__}")
        if not isinstance(self.fold, bool):
            raise QueryRefused(f"fold: expected true or false, got {type(self.fold).__name__}")
        # frozen: the checked forms are set once, here (a replace() checks them again, unchanged)
        for name, value in (("image", image), ("top_k", check_top_k(self.top_k)), ("lang", check_lang(self.lang)),
                            ("where", conditions(self.where)), ("facets", check_facets(self.facets))):
            object.__setattr__(self, name, value)

    def where_json(self) -> list[list]:
        """The conditions as they cross the wire: a JSON array of triples."""
        return [c.to_json() for c in self.where]
