"""The pictures' own fields as typed columns, one row per image cache row: what the filters read (docs/filters.md).

Layout of the store directory (kind "image_fields"), rows in the image cache's row order:
  col-0000.npy    one array [N] per field, in the manifest's `columns` order: a date as int64 UTC seconds, a number
                  as float64, a string as int32 codes into its vocabulary; a row without the field holds MISSING
  col-0000.json   a string field's vocabulary (its distinct values, code = position)
  manifest.json   format version, columns [{name, kind}], num_rows, the image cache build it follows
                  (cache_fingerprint) and its ids (ids_sha)

A field's type is the collection's (`cfir_jax.core.picture_fields`). The builder is `cfir_jax.builders.image_fields`;
an add appends rows (new fields become columns, MISSING for the older rows), a compact keeps the rows the image cache
keeps, and a removal needs nothing (removed rows are never returned: `cfir_jax.search.live_rows`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from cfir_jax.core.errors import StoreError
from cfir_jax.core.picture_fields import DATE, NUMBER, STRING
from cfir_jax.stores.contract import Store

KIND = "image_fields"
FORMAT_VERSION = 1
DTYPES = {DATE: np.int64, NUMBER: np.float64, STRING: np.int32}
MISSING = {DATE: np.iinfo(np.int64).min, NUMBER: np.nan, STRING: -1}


def column_file(j: int) -> str:
    return f"col-{j:04d}"


class Column:
    """One field: `kind`, `values` [N] (DTYPES[kind], MISSING where a row has none), `vocab` (strings only)."""

    def __init__(self, name: str, kind: str, values: np.ndarray, vocab: list[str] | None = None):
        self.name, self.kind, self.values, self.vocab = name, kind, values, vocab or []

    def present(self) -> np.ndarray:
        """bool [N]: the rows that have a value."""
        if self.kind == NUMBER:
            return ~np.isnan(self.values)
        return self.values != MISSING[self.kind]


class ImageFields(Store):
    """An opened image_fields store: `columns` {name: Column}, `num_rows`."""

    KIND, VERSION, STAGE = KIND, FORMAT_VERSION, "image_fields"

    def __init__(self, path: Path, manifest: dict, columns: dict[str, Column]):
        self.path, self.manifest, self.columns = path, manifest, columns

    @property
    def num_rows(self) -> int:
        return int(self.manifest["num_rows"])

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
                    if kind == STRING else None
            except (OSError, ValueError) as e:
                raise StoreError(f"{path}: incomplete image fields store ({e.__class__.__name__}); rebuild it with "
                                 "index.py --stages image_fields") from None
            if values.shape != (n,) or values.dtype != DTYPES.get(kind):
                raise StoreError(f"{path}: column {name!r} is {values.dtype} {values.shape}, the manifest says {kind} "
                                 f"({n},); rebuild it with index.py --stages image_fields")
            columns[name] = Column(name, kind, values, vocab)
        return cls(path, manifest, columns)
