"""Facets: how many of the images a query ranked hold each value of a field (docs/filters.md), the counts a search
page shows beside its hits, as Elasticsearch's terms aggregations or Solr's facets do.

A query asks for fields (`Query.facets`, `DocumentInput.facets`); its answer carries, per field, the
`MAX_VALUES` values most images hold (ties by value) and `ranked`, the number of images counted. They are
counted over the rows the query ranked, before the cut to top_k (`ranked_rows`): CFIR's union that SR scored (its
candidates, which ER formed of passing images only), or a method's whole ranking up to retrieval.top_k (the dense
methods, CFIR's no-entity fallback, BM25, search by image). With folding, each group of near-duplicates counts once,
as its best-ranked member (the one shown).

Counting is numpy over image cache rows: each field's codes per row are made once per opened store (`Facets`), then a
query's counts are one `np.bincount` per field. A string or a boolean counts its value, a list each value it holds
(once per image), a date its month in the store's zone ("2020-06"); a number field is refused in one line, and so
is an unknown field (`FacetError`: exit 2, 422). A Retriever's `RowFilter.facets()` holds its `Facets`.
"""

from __future__ import annotations

import datetime as dt
import threading
import zoneinfo
from collections.abc import Sequence

import numpy as np

from cfir_jax.core.image_field_types import BOOLEAN, DATE, LIST, NUMBER
from cfir_jax.core.query_rule import QueryRefused

__all__ = ["MAX_VALUES", "FacetError", "Facets", "ranked_rows"]

MAX_VALUES = 20  # the values shown per field, most images first (issue 61: a search page's list)
# A list field's rows are also kept as a padded table [rows, the most values a row holds] when it is at most this
# many times its values' count: a query then counts with one gather instead of a ragged one (4x faster at 1M rows)
TABLE_PADDING = 4


class FacetError(QueryRefused):
    """A facet that cannot be counted: an unknown field, or a number field (exit 2, 422)."""


class _Codes:
    """One field as facets count it. A string, boolean or date: `codes` [N], each row's value's code plus one (0:
    none), and `vocab`; a list: `codes` [N], the values each row holds (-1: none), its `items` and `starts`, and, where
    its rows hold few values each, `table` [N, most values a row holds], each value's code plus one (0: padding).
    Shifted by one so that a query's count is a gather and one bincount, with no mask to drop the rows without."""

    def __init__(self, codes: np.ndarray, vocab: list[str], items: np.ndarray | None = None,
                 starts: np.ndarray | None = None, table: np.ndarray | None = None):
        self.vocab, self.items, self.starts = vocab, items, starts
        if items is None:
            self.codes = _shifted(codes, len(vocab))
        else:  # signed, -1 none, in the narrowest integers that hold the most values a row holds
            self.codes = codes.astype(np.min_scalar_type(-max(int(codes.max(initial=0)), 1)))
        self.table = None if table is None else _shifted(table, len(vocab))


def _shifted(codes: np.ndarray, size: int) -> np.ndarray:
    """codes + 1 (-1 becomes 0) in the narrowest unsigned integers that hold them: a query's gather reads scattered
    rows, so fewer bytes, fewer cache misses."""
    return (codes.astype(np.int64) + 1).astype(np.min_scalar_type(size))


def _months(column) -> _Codes:
    """A date field's month of each row in the store's zone: the zone's month starts (UTC seconds) over the
    column's span, each row's month found by a binary search (a zone's offset changes with the date)."""
    present = column.present()
    if not present.any():
        return _Codes(np.full(len(column.values), -1, np.int32), [])
    seconds = column.values[present]
    zone = zoneinfo.ZoneInfo(column.zone)
    first = dt.datetime.fromtimestamp(int(seconds.min()), dt.UTC)
    last = dt.datetime.fromtimestamp(int(seconds.max()), dt.UTC)
    # From a month before (the zone's clock may still be in it) to a month after, each as year * 12 + month - 1.
    indices = range(max(12, first.year * 12 + first.month - 2), min(last.year * 12 + last.month, 9999 * 12 + 11) + 1)
    months = [f"{i // 12:04d}-{i % 12 + 1:02d}" for i in indices]
    starts = [int(dt.datetime(i // 12, i % 12 + 1, 1, tzinfo=zone).timestamp()) for i in indices]
    codes = np.full(len(column.values), -1, np.int32)
    codes[present] = np.searchsorted(np.array(starts, np.int64), seconds, side="right") - 1
    return _Codes(codes, months)


def _distinct_items(column) -> _Codes:
    """A list field with each row's values once (a list may repeat one): sorted once, here, so that a query's count
    is a gather and a bincount."""
    counts = np.maximum(column.values, 0)
    size = max(1, len(column.vocab))
    keys = np.sort(np.repeat(np.arange(len(counts), dtype=np.int64), counts) * size + column.items)
    keys = keys[np.concatenate([[True], keys[1:] != keys[:-1]])] if len(keys) else keys
    held = np.bincount(keys // size, minlength=len(counts))
    codes = np.where(column.values < 0, -1, held).astype(np.int64)
    items, starts = (keys % size).astype(np.int32), np.concatenate([[0], np.cumsum(held)])
    widest = int(held.max()) if len(held) else 0
    table = None
    if 0 < widest and len(held) * widest <= TABLE_PADDING * len(items):  # a query's count: one gather of its rows
        table = np.full((len(held), widest), -1, np.int32)
        table[np.repeat(np.arange(len(held)), held), np.arange(len(items)) - np.repeat(starts[:-1], held)] = items
    return _Codes(codes, column.vocab, items, starts, table)


def _codes_of(column) -> _Codes:
    if column.kind == DATE:
        return _months(column)
    if column.kind == BOOLEAN:
        return _Codes(column.values.astype(np.int32), ["false", "true"])
    if column.kind == LIST:
        return _distinct_items(column)
    return _Codes(column.values, column.vocab)  # a string: its codes


class Facets:
    """The facets of one opened image_fields store (`cfir_jax.stores.image_fields.ImageFields`): `check(names)` says
    a query's refusals before it runs, `count(rows, names)` counts; each field's codes are made at its first count."""

    def __init__(self, store):
        self.store = store
        self._codes: dict[str, _Codes] = {}
        self._lock = threading.Lock()  # the batcher's thread and the image queue's threads share the codes

    def check(self, names: Sequence[str]) -> None:
        for name in names:
            column = self.store.columns.get(name)
            if column is None:
                known = ", ".join(sorted(self.store.columns)) or "none: no image of this index carries fields"
                raise FacetError(f"facets: unknown field {name!r} (the images' fields: {known})")
            if column.kind == NUMBER:
                raise FacetError(f"facets: {name} is a number field, which is not counted; ask a string, list, "
                                 "boolean or date field")

    def _field(self, name: str) -> _Codes:
        with self._lock:
            if name not in self._codes:
                self._codes[name] = _codes_of(self.store.columns[name])
            return self._codes[name]

    def count(self, rows: np.ndarray, names: Sequence[str]) -> dict[str, dict[str, int]]:
        """{field: {value: images of `rows` holding it}}, the MAX_VALUES largest by count, ties by value."""
        self.check(names)
        return {name: _largest(self._counts(self._field(name), rows), self._field(name).vocab) for name in names}

    def count_retrievals(self, names: Sequence[Sequence[str]], retrievals: Sequence,
                         groups: Sequence[np.ndarray | None]) -> None:
        """Sets each retrieval's `facets` to (counts, ranked) where its query asks for facets (`names`, each its own);
        `groups`: each one's near-duplicate labels where it is folded, else None."""
        for asked, r, group in zip(names, retrievals, groups):
            if asked:
                rows = ranked_rows(r, group)
                r.facets = (self.count(rows, asked), int(len(rows)))

    @staticmethod
    def _counts(field: _Codes, rows: np.ndarray) -> np.ndarray:
        size = max(1, len(field.vocab))
        if not len(rows):  # a query that ranked nothing (its filter passed none): no counts
            return np.zeros(size, np.int64)
        # np.take, not rows as an index: 5x faster on a table's rows (numpy's fancy indexing copies a row at a time)
        if field.items is None:
            return np.bincount(np.take(field.codes, rows), minlength=size + 1)[1:]
        if field.table is not None:  # a list, few values a row: its rows' values, padding counted at 0 and dropped
            return np.bincount(np.take(field.table, rows, axis=0).ravel(), minlength=size + 1)[1:]
        take = np.maximum(field.codes[rows], 0)  # a list: each value it holds (once: `_distinct_items`)
        at = np.repeat(field.starts[rows] - np.concatenate([[0], np.cumsum(take)[:-1]]), take) + \
            np.arange(int(take.sum()))
        return np.bincount(field.items[at], minlength=size)


def _largest(counts: np.ndarray, vocab: list[str]) -> dict[str, int]:
    """The MAX_VALUES values of `vocab` with the largest counts (none of 0), most first, ties by value."""
    held = np.flatnonzero(counts)
    if len(held) > MAX_VALUES:  # those at least as large as the MAX_VALUES-th count, then sorted exactly
        floor = np.partition(counts[held], len(held) - MAX_VALUES)[len(held) - MAX_VALUES]
        held = held[counts[held] >= floor]
    order = sorted(held.tolist(), key=lambda j: (-int(counts[j]), vocab[j]))[:MAX_VALUES]
    return {vocab[j]: int(counts[j]) for j in order}


def ranked_rows(retrieval, group: np.ndarray | None) -> np.ndarray:
    """The cache rows a query ranked: its hits' rows, then the rest of what it ranked (`Retrieval.ranked_rows`, CFIR's
    union) in its order; with `group` (near-duplicates' labels), each group once, as its first (best-ranked) row."""
    rows = retrieval.hit_rows()
    union = getattr(retrieval, "ranked_rows", None)
    if union is not None and len(union):
        union = np.asarray(union, np.int64)
        rows = np.concatenate([rows, _without(union, rows)]) if len(rows) else union
    if group is None or not len(rows):
        return rows
    labels = np.where(rows < len(group), group[np.minimum(rows, len(group) - 1)], -1)
    grouped = np.flatnonzero(labels >= 0)
    _, first = np.unique(labels[grouped], return_index=True)
    keep = labels < 0
    keep[grouped[first]] = True
    return rows[keep]


def _without(union: np.ndarray, hits: np.ndarray) -> np.ndarray:
    """The rows of `union` that are not `hits` (a few), in the union's order. The union is ascending (ER's and BM25's
    unions are made sorted): each hit found by a binary search, O(hits x log union); else a table lookup."""
    if len(union) > 1 and not (union[1:] >= union[:-1]).all():
        return union[~np.isin(union, hits, kind="table")]
    at = np.minimum(np.searchsorted(union, hits), len(union) - 1)
    return np.delete(union, at[union[at] == hits])
