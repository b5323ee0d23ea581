"""The image_fields stage's build: the images' own fields (date, source, license, ...) of every image cache row as
the typed columns that `cfir_jax.stores.image_fields` reads and the filters mask with (docs/filters.md).

- build: every cached row's fields read from the corpus, typed by the collection's types (the corpus manifest's
  `image_fields`, fixed on first sight by `cfir_jax.core.image_field_types`).
- after an add: the new rows appended; a field first seen in the addition becomes a column, MISSING for older rows.
- after a remove: nothing (removed rows are never returned: `cfir_jax.search.live_rows`).
- after a compact: the rows the image cache keeps, in its order.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from cfir_jax.builders.descriptor import EXTEND, REMAP, Build, Changes, Stage, StageRun, Step, declare
from cfir_jax.builders.image_cache_update import row_map
from cfir_jax.builders.store_update import ChangeRun
from cfir_jax.core.image_field_types import LIST, STRING, FieldTypes, value_of
from cfir_jax.stores.contract import StoreError, atomic_dir, write_manifest
from cfir_jax.stores.image_fields import (
    DTYPES,
    FORMAT_VERSION,
    KIND,
    MISSING,
    WITH_VOCAB,
    Column,
    ImageFields,
    column_file,
)

if TYPE_CHECKING:
    from cfir_jax.data.corpus import Corpus
    from cfir_jax.stores.image_cache import ImageCache


def _ids_sha(ids: Sequence[str]) -> str:
    return hashlib.sha256("\n".join(ids).encode()).hexdigest()[:16]


def row_fields(corpus: Corpus, ids: Sequence[str]) -> list[dict[str, Any]]:
    """The raw fields of each image `ids` (cache rows) names, {} where it has none."""
    if not corpus.manifest.get("image_fields"):
        return [{} for _ in ids]
    row_of = {image_id: r for r, image_id in enumerate(corpus.image_ids)}
    return [dict(corpus.image(row_of[i]).fields) for i in ids]


def columns_of(rows: list[Mapping[str, Any]], kinds: Mapping[str, str], zone: str = "UTC") -> dict[str, Column]:
    """The typed columns of `rows` (each held to `kinds`, the collection's types; one line naming the row else), their
    dates without an offset read in `zone`."""
    types = FieldTypes(kinds)
    for n, row in enumerate(rows):
        types.check(f"image row {n}", row)
    out = {}
    for name, kind in sorted(types.kinds.items()):
        values = np.full(len(rows), MISSING[kind], DTYPES[kind])
        vocab: dict[str, int] = {}
        items: list[int] = []
        for n, row in enumerate(rows):
            if row.get(name) is None:
                continue
            v = value_of(kind, row[name], zone)
            if kind == LIST:
                items += [vocab.setdefault(t, len(vocab)) for t in v]
                values[n] = len(v)
            else:
                values[n] = vocab.setdefault(v, len(vocab)) if kind == STRING else v
        out[name] = Column(name, kind, values, list(vocab) if kind in WITH_VOCAB else None,
                           np.array(items, np.int32), zone)
    return out


def _missing(name: str, kind: str, n: int, zone: str) -> Column:
    return Column(name, kind, np.full(n, MISSING[kind], DTYPES[kind]), [], None, zone)


def concat(old: dict[str, Column], new: dict[str, Column], n_old: int, n_new: int) -> dict[str, Column]:
    """Old rows then new rows, per field; a field one side lacks is MISSING there; string and list codes re-mapped."""
    out = {}
    for name in sorted(set(old) | set(new)):
        kind, zone = (old.get(name) or new[name]).kind, (old.get(name) or new[name]).zone
        a = old[name] if name in old else _missing(name, kind, n_old, zone)
        b = new[name] if name in new else _missing(name, kind, n_new, zone)
        if kind not in WITH_VOCAB:
            out[name] = Column(name, kind, np.concatenate([a.values, b.values]), zone=zone)
            continue
        vocab = {v: j for j, v in enumerate(a.vocab)}
        codes = np.array([vocab.setdefault(v, len(vocab)) for v in b.vocab] + [-1], np.int32)  # -1: MISSING
        values, items = b.values, codes[b.items]
        if kind == STRING:
            values = codes[np.where(b.values >= 0, b.values, -1)]
        out[name] = Column(name, kind, np.concatenate([a.values, values]), list(vocab),
                           np.concatenate([a.items, items]).astype(np.int32), zone)
    return out


def write_store(out_dir: str | os.PathLike, columns: dict[str, Column], cache: ImageCache, start: float,
                zone: str = "UTC") -> ImageFields:
    """Writes a complete store for the rows of `cache`, its dates without an offset read in `zone`."""
    with atomic_dir(out_dir) as tmp:
        for j, c in enumerate(columns.values()):
            if len(c.values) != cache.num_images:
                raise StoreError(f"{out_dir}: {len(c.values)} rows of {c.name!r} for a cache of {cache.num_images}")
            np.save(tmp / f"{column_file(j)}.npy", c.values)
            if c.kind == LIST:
                np.save(tmp / f"{column_file(j)}.items.npy", c.items.astype(np.int32))
            if c.kind in WITH_VOCAB:
                (tmp / f"{column_file(j)}.json").write_text(json.dumps(c.vocab, ensure_ascii=False), encoding="utf-8")
        write_manifest(tmp, KIND, FORMAT_VERSION, columns=[{"name": c.name, "kind": c.kind} for c in columns.values()],
                       num_rows=cache.num_images, timezone=zone, cache_fingerprint=cache.content_fingerprint,
                       ids_sha=_ids_sha(cache.ids), build_seconds=round(time.time() - start, 3))
    return ImageFields.open(out_dir)


def build_image_fields(out_dir: str | os.PathLike, corpus: Corpus, cache: ImageCache, zone: str) -> ImageFields:
    """The store for every row of `cache`, dates without an offset read in `zone`; a current one (same cache build,
    same zone) is reused."""
    try:
        return ImageFields.open(out_dir, cache_fingerprint=cache.content_fingerprint, num_rows=cache.num_images,
                                timezone=zone)
    except StoreError:
        pass
    start = time.time()
    kinds = corpus.manifest.get("image_fields") or {}
    return write_store(out_dir, columns_of(row_fields(corpus, cache.ids), kinds, zone), cache, start, zone)


def image_fields_after_add(change: ChangeRun, out: Path) -> dict:
    """W/image_fields with the new cache rows' fields appended."""
    old, cache, corpus = change.old("image_fields"), change.new("image_cache"), change.new("corpus")
    if cache.num_images < old.num_rows or _ids_sha(cache.ids[: old.num_rows]) != old.manifest["ids_sha"]:
        raise StoreError(f"{old.path}: the image cache does not extend the rows this store was built for; rebuild "
                         "it with index.py --stages image_fields")
    kinds = {**old.kinds, **(corpus.manifest.get("image_fields") or {})}
    # The new rows' dates are read in the store's zone, so its rows agree (a changed index.fields.timezone
    # rebuilds the whole store at the next index.py).
    new = columns_of(row_fields(corpus, cache.ids[old.num_rows :]), kinds, old.zone)
    store = write_store(out, concat(old.columns, new, old.num_rows, cache.num_images - old.num_rows), cache,
                        time.time(), old.zone)
    return {"rows": store.num_rows, "fields": len(store.columns)}


def image_fields_after_compaction(change: ChangeRun, out: Path) -> dict:
    """W/image_fields without the rows the compaction dropped (the image cache's row map)."""
    old = change.old("image_fields")
    keep = np.flatnonzero(row_map(change) >= 0)
    columns = {n: c.take(keep) for n, c in old.columns.items()}
    store = write_store(out, columns, change.new("image_cache"), time.time(), old.zone)
    return {"rows": store.num_rows}


def build_stage(run: StageRun) -> ImageFields:
    """Stage image_fields, on process 0 alone (the others wait, then open it)."""
    return build_image_fields(run.layout.image_fields, run.opened["corpus"], run.opened["image_cache"],
                              run.config.index.fields.timezone)


def open_stage(run: StageRun) -> ImageFields:
    return ImageFields.open(run.layout.image_fields, cache_fingerprint=run.opened["image_cache"].content_fingerprint)


def stage_summary(store: ImageFields) -> str:
    """The stage's line of index.py's closing table."""
    if not store.columns:
        return f"no fields on {store.num_rows:,} images"
    fields = ", ".join(f"{c.name} ({c.kind}, {int(c.present().sum()):,})" for c in store.columns.values())
    return f"{len(store.columns)} fields over {store.num_rows:,} images: {fields}"


declare(Stage("image_fields", reader=ImageFields.open,
              build=Build(build_stage, stage_summary, every_host=False, open=open_stage),
              changes=Changes(add=Step(EXTEND, image_fields_after_add),
                              compact=Step(REMAP, image_fields_after_compaction))))
