"""The images' own fields as typed columns, one row per image cache row: what the filters read (docs/filters.md).

Layout of the store directory (kind "image_fields"), rows in the image cache's row order:
  col-0000.npy        one array [N] per field, in the manifest's `columns` order: a date as int64 UTC seconds, a
                      number as float64, a boolean as int8 0/1, a string as int32 codes into its vocabulary, a list
                      as int32 counts (its items, in order, in col-0000.items.npy); a row without the field holds
                      MISSING
  col-0000.items.npy  a list field's items [sum of counts], int32 codes into its vocabulary, row after row
  col-0000.json       a string or list field's vocabulary (its distinct values, code = position)
  manifest.json       format version, columns [{name, kind}], num_rows, the zone dates without an offset were read in
                      (timezone: index.fields.timezone), the image cache build it follows (cache_fingerprint) and its
                      ids (ids_sha)

A field's type is the collection's (`cfir_jax.core.image_field_types`). The builder is `cfir_jax.builders.image_fields`;
an add appends rows (new fields become columns, MISSING for the older rows), a compact keeps the rows the image cache
keeps, and a removal needs nothing (removed rows are never returned: `cfir_jax.search.live_rows`). Format 2 added
booleans, lists and the zone; a store of format 1 is refused in one line (index.py rebuilds it).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from cfir_jax.core.errors import StoreError
from cfir_jax.core.image_field_types import BOOLEAN, DATE, LIST, NUMBER, STRING
from cfir_jax.stores.contract import Store

KIND = "image_fields"
FORMAT_VERSION = 2
DTYPES = {DATE: np.int64, NUMBER: np.float64, STRING: np.int32, BOOLEAN: np.int8, LIST: np.int32}
MISSING = {DATE: np.iinfo(np.int64).min, NUMBER: np.nan, STRING: -1, BOOLEAN: -1, LIST: -1}
WITH_VOCAB = (STRING, LIST)


def column_file(j: int) -> str:
    return f"col-{j:04d}"


class Column:
    """One field: `kind`, `values` [N] (DTYPES[kind], MISSING where a row has none), `vocab` (strings and lists),
    `items` (a list field's codes, row after row, `values` of them a row) and `zone` (the zone of its dates)."""

    def __init__(self, name: str, kind: str, values: np.ndarray, vocab: list[str] | None = None,
                 items: np.ndarray | None = None, zone: str = "UTC"):
        self.name, self.kind, self.values, self.vocab, self.zone = name, kind, values, vocab or [], zone
        self.items = items if items is not None else np.zeros(0, np.int32)
        self._code_of: dict[str, int] | None = None
        self._ends: np.ndarray | None = None

    def present(self) -> np.ndarray:
        """bool [N]: the rows that have a value (an empty list is a value)."""
        if self.kind == NUMBER:
            return ~np.isnan(self.values)
        return self.values != MISSING[self.kind]

    def code_of(self) -> dict[str, int]:
        """{value: code} of a string or list field's vocabulary, made once (a filter looks its values up in it)."""
        if self._code_of is None:
            self._code_of = {v: j for j, v in enumerate(self.vocab)}
        return self._code_of

    def rows_of(self, at: np.ndarray) -> np.ndarray:
        """int [len(at)]: the row each item at positions `at` of a list field's `items` belongs to (a binary search
        over the rows' ends, made once: a filter's few hits cost little, whatever the number of items)."""
        if self._ends is None:
            self._ends = np.cumsum(np.maximum(self.values, 0))
        return np.searchsorted(self._ends, at, side="right")

    def take(self, rows: np.ndarray) -> Column:
        """The column of `rows` (indices, in their order)."""
        items = self.items
        if self.kind == LIST:
            counts = np.maximum(self.values, 0)
            starts = np.concatenate([[0], np.cumsum(counts)])[rows]
            take = counts[rows]
            items = self.items[np.repeat(starts - np.concatenate([[0], np.cumsum(take)[:-1]]), take)
                               + np.arange(int(take.sum()))]
        return Column(self.name, self.kind, self.values[rows], self.vocab, items, self.zone)


class ImageFields(Store):
    """An opened image_fields store: `columns` {name: Column}, `num_rows`, `zone`."""

    KIND, VERSION, STAGE = KIND, FORMAT_VERSION, "image_fields"

    def __init__(self, path: Path, manifest: dict, columns: dict[str, Column]):
        self.path, self.manifest, self.columns = path, manifest, columns

    @property
    def num_rows(self) -> int:
        return int(self.manifest["num_rows"])

    @property
    def zone(self) -> str:
        return str(self.manifest["timezone"])

    @property
    def kinds(self) -> dict[str, str]:
        return {name: c.kind for name, c in self.columns.items()}

    @classmethod
    def load(cls, path: Path, manifest: dict) -> ImageFields:
        n, columns = manifest.get("num_rows"), {}
        for j, spec in enumerate(manifest.get("columns", [])):
            name, kind = spec["name"], spec["kind"]
            try:
                values = np.load(path / f"{column_file(j)}.npy")
                vocab = json.loads((path / f"{column_file(j)}.json").read_text(encoding="utf-8")) \
                    if kind in WITH_VOCAB else None
                items = np.load(path / f"{column_file(j)}.items.npy") if kind == LIST else None
            except (OSError, ValueError) as e:
                raise StoreError(f"{path}: incomplete image fields store ({e.__class__.__name__}); rebuild it with "
                                 "index.py --stages image_fields") from None
            if values.shape != (n,) or values.dtype != DTYPES.get(kind) or (
                    items is not None and (items.dtype != np.int32 or len(items) != np.maximum(values, 0).sum())):
                raise StoreError(f"{path}: column {name!r} is {values.dtype} {values.shape}, the manifest says {kind} "
                                 f"({n},); rebuild it with index.py --stages image_fields")
            columns[name] = Column(name, kind, values, vocab, items, manifest.get("timezone", "UTC"))
        return cls(path, manifest, columns)
