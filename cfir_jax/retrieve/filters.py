"""Filters on the images' own fields (docs/filters.md): `date<=2020-06-30`, `source=reuters`, `license in cc-by,cc0`.

A filter is a list of conditions joined by AND, each `FIELD OP VALUE` with OP one of `= != < <= > >=`, or
`FIELD in V1,V2,...`. It becomes one boolean mask over the image cache's rows (`Filter.mask`, from the image_fields
store, `cfir_jax.stores.image_fields`), which retrieval applies before ranking: the rows that fail it are treated
as removed (`cfir_jax.search.live_rows`), so ER's union, BM25, SR's whole-cache searches and search by image only
ever hold images that pass, and `top_k` counts only those.

Values take their field's type: a date field compares ISO dates, each covering its span at its own precision (a
year, a month, a day, a minute, a second: `date<=2020-06-30T14:05` keeps 14:05:30), read in the index's zone unless
it carries an offset; a number field numbers; a string field strings (exactly); a list field holds a value or not
(`tags=sport`, `tags!=sport`, `tags in a,b`); a boolean is `true` or `false`.
An image without the field fails every condition on it, `!=` included. An unknown field, an operator a line does
not hold, or a value of the wrong type is one line (`FilterError`, a CfirError: exit 2 on the command line, 422 on
the service).
"""

from __future__ import annotations

import collections
import operator
import threading
from collections.abc import Callable, Sequence

import numpy as np

from cfir_jax.core.image_field_types import BOOLEAN, DATE, LIST, NUMBER, date_span
from cfir_jax.core.query_rule import OPS, Condition, FilterError, conditions, parse
from cfir_jax.retrieve.facets import Facets
from cfir_jax.search.live_rows import LiveRows
from cfir_jax.stores.image_fields import ImageFields

__all__ = ["OPS", "Condition", "Filter", "FilterError", "RowFilter", "condition_mask", "parse"]

_COMPARE = {"=": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le, ">": operator.gt,
            ">=": operator.ge}
MASKS_KEPT = 16  # the masks of the last filters a RowFilter checked or applied (a batch's: checked, then applied)


def _number(cond: Condition, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise FilterError(f"filter '{cond}': {cond.field} is a number, {text!r} is not") from None
    if value != value:
        raise FilterError(f"filter '{cond}': {cond.field} is a number, {text!r} is not")
    return value


def _date_mask(cond: Condition, column, text: str) -> np.ndarray:
    """A date at its own precision covers its span ([lo, hi): a year ... a second), read in the store's zone unless
    it carries an offset: `date<=2020-06-30T14:05` keeps 14:05:30, `date>2020-06-30T14:05` does not."""
    try:
        lo, hi = date_span(text, column.zone)
    except ValueError as e:
        raise FilterError(f"filter '{cond}': {cond.field} is a date; {e}") from None
    values = column.values
    inside = (values >= lo) & (values < hi)
    out = {"=": inside, "in": inside, "!=": ~inside, "<": values < lo, "<=": values < hi, ">": values >= hi,
           ">=": values >= lo}[cond.op]
    return out & column.present()


def _unordered(cond: Condition, column) -> None:
    if cond.op not in ("=", "!=", "in"):
        what = "a list of strings (a list holds a value or not)" if column.kind == LIST else "true or false"
        raise FilterError(f"filter '{cond}': {cond.field} is {what}; use =, != or in, not {cond.op}")


def _codes(cond: Condition, column) -> np.ndarray:
    """The codes of `cond`'s values in the column's vocabulary, each looked up once (a value it lacks has none)."""
    code = column.code_of()
    return np.array([code[v] for v in cond.values if v in code], np.int32)


def _held(cond: Condition, holds: np.ndarray, column) -> np.ndarray:
    """The rows that pass `cond` from those holding one of its values: `!=` the present rows that do not."""
    return column.present() & ~holds if cond.op == "!=" else holds


def _list_mask(cond: Condition, column) -> np.ndarray:
    """`tags=sport`: the list holds "sport"; `tags!=sport`: it does not; `tags in a,b`: it holds either."""
    _unordered(cond, column)
    holds = np.zeros(len(column.values), bool)
    holds[column.rows_of(np.flatnonzero(np.isin(column.items, _codes(cond, column))))] = True
    return _held(cond, holds, column)


def _boolean_mask(cond: Condition, column) -> np.ndarray:
    _unordered(cond, column)
    wanted = []
    for text in cond.values:
        if text.lower() not in ("true", "false"):
            raise FilterError(f"filter '{cond}': {cond.field} is true or false, {text!r} is neither")
        wanted.append(int(text.lower() == "true"))
    return _held(cond, np.isin(column.values, wanted), column)


def _string_mask(cond: Condition, column) -> np.ndarray:
    if cond.op in ("=", "!=", "in"):
        return _held(cond, np.isin(column.values, _codes(cond, column)), column)
    compare = _COMPARE[cond.op]  # an order: each distinct value compared once, then looked up by code
    ok = np.array([bool(compare(v, cond.values[0])) for v in column.vocab] + [False], bool)
    return ok[np.where(column.values >= 0, column.values, len(column.vocab))]


def _number_mask(cond: Condition, column) -> np.ndarray:
    compare = _COMPARE["=" if cond.op == "in" else cond.op]
    passed = np.zeros(len(column.values), bool)
    with np.errstate(invalid="ignore"):
        for text in cond.values:
            passed |= compare(column.values, _number(cond, text))
    return passed & column.present()


def condition_mask(cond: Condition, column) -> np.ndarray:
    """bool [N]: the rows of `column` (a stores.image_fields.Column) that pass `cond`; an image without the field
    fails every condition on it, `!=` included. `=`, `!=` and `in` look each of the condition's values up once in
    the field's vocabulary (cost: the values plus the rows, never values x vocabulary)."""
    if column.kind == DATE:
        passed = np.zeros(len(column.values), bool)
        for text in cond.values:
            passed |= _date_mask(cond, column, text)
        return passed
    return {LIST: _list_mask, BOOLEAN: _boolean_mask, NUMBER: _number_mask}.get(column.kind, _string_mask)(
        cond, column)


class Filter:
    """Conditions joined by AND (`cfir_jax.core.query_rule.Condition`s; lines and triples are parsed by
    `cfir_jax.core.query_rule.conditions`); `mask(store)` -> bool [N] over the image cache's rows."""

    def __init__(self, where: Sequence[Condition] | Sequence[str] | str | None):
        self.conditions = conditions(where)

    def __bool__(self) -> bool:
        return bool(self.conditions)

    def __str__(self) -> str:
        return " AND ".join(str(c) for c in self.conditions)

    def mask(self, store) -> np.ndarray:
        """bool [store.num_rows]: the rows passing every condition; an unknown field is one line naming the known."""
        passed = np.ones(store.num_rows, bool)
        for cond in self.conditions:
            column = store.columns.get(cond.field)
            if column is None:
                known = ", ".join(sorted(store.columns)) or "none: no image of this index carries fields"
                raise FilterError(f"filter '{cond}': unknown field {cond.field!r} (the images' fields: {known})")
            passed &= condition_mask(cond, column)
        return passed


class RowFilter:
    """A Retriever's filters: the image_fields store of its workdir (opened on the first filter, held to its image
    cache), the masks of the last MASKS_KEPT filters (`check` made them: applying one is a look-up) and, per call,
    the rows a filter lets a query return (`applied`)."""

    def __init__(self, stores):
        self.stores = stores
        self._fields = None
        self._facets: Facets | None = None
        self._masks: collections.OrderedDict[tuple[Condition, ...], np.ndarray] = collections.OrderedDict()
        self._lock = threading.Lock()  # the batcher's thread and the image queue's threads share the masks

    def fields(self):
        if self._fields is None:
            path = self.stores.layout.image_fields
            if not (path / "manifest.json").is_file():
                raise FilterError(f"{path}: no fields store, so no filter applies; run index.py on this workdir "
                                  "(its image_fields stage)")
            self._fields = ImageFields.open(path, cache_fingerprint=self.stores.cache.content_fingerprint,
                                            num_rows=self.stores.cache.num_images)
        return self._fields

    def facets(self) -> Facets:
        """The facets of its fields store (`cfir_jax.retrieve.facets`), made at the first facet asked."""
        store = self.fields()
        if self._facets is None or self._facets.store is not store:
            self._facets = Facets(store)
        return self._facets

    def check(self, where: tuple[Condition, ...]) -> np.ndarray:
        """bool [N]: the rows passing `where`, or the FilterError it meets (an unknown field, a value of the wrong
        type) before any retrieval runs; kept, so that its retrieval applies it without reading it again."""
        with self._lock:
            if where in self._masks:
                self._masks.move_to_end(where)
                return self._masks[where]
        mask = Filter(where).mask(self.fields())
        with self._lock:
            self._masks[where] = mask
            while len(self._masks) > MASKS_KEPT:
                self._masks.popitem(last=False)
        return mask

    def rows(self, where: tuple[Condition, ...], live: LiveRows) -> tuple[LiveRows, str]:
        """(the rows of `live` that pass `where`, a note saying how many) or (`live`, "") without a filter. live: the
        rows the call may return before its filter (the version's live rows, or fewer: folding's refill)."""
        if not where:
            return live, ""
        shown = Filter(where)
        removed = ~self.check(where)
        if live.removed is not None:
            removed |= live.removed
        rows = LiveRows(removed, live.num_rows)
        if rows.num_live == 0:
            return rows, f"no image passes the filter {shown}: nothing to rank"
        return rows, f"filtered by {shown}: {rows.num_live:,} of {live.num_live:,} images pass"

    def run(self, docs: Sequence, live: LiveRows, retrieve: Callable[[list, LiveRows], list],
            empty: Callable[[str, int], list]) -> list:
        """`retrieve(docs, rows)`'s results, each document (a `DocumentInput`) searched under its own conditions
        (`doc.where`) over the rows of `live` that pass them (`rows`, the argument every part of the call scores
        with), documents of one filter together (their notes say it); `empty(note, n)` for the n documents of a
        filter nothing passes."""
        keys = [d.where for d in docs]
        out: list = [None] * len(docs)
        for key in dict.fromkeys(keys):
            at = [i for i, k in enumerate(keys) if k == key]
            part = [docs[i] for i in at] if len(at) < len(docs) else list(docs)
            rows, note = self.rows(key, live)
            results = empty(note, len(part)) if key and not rows.num_live else retrieve(part, rows)
            for i, r in zip(at, results):
                if note and rows.num_live:
                    r.note = "; ".join(n for n in (r.note, note) if n)
                if key:  # the note's count, as a field (`Retrieval.passed`)
                    r.passed = (rows.num_live, live.num_live)
                out[i] = r
        return out
