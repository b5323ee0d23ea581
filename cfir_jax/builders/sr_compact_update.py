"""The compact scoring copies under changes of the collection (their builder is retrieval's, on demand:
`cfir_jax.search.compact`): W/sr_compact gains the appended cache rows quantised with its stored rotation, and keeps
the rows a compaction keeps; W/sr_compact_fused is dropped by both (retrieval rebuilds it on first use)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from cfir_jax.builders.descriptor import DROP, EXTEND, REMAP, Changes, Stage, Step, declare
from cfir_jax.builders.image_cache_update import row_map
from cfir_jax.builders.store_update import ChangeRun
from cfir_jax.core.errors import StoreError
from cfir_jax.search.compact import COMPACT_KIND, COMPACT_VERSION, quantize_rows
from cfir_jax.stores.atomic_write import link_tree
from cfir_jax.stores.contract import read_manifest, write_manifest
from cfir_jax.stores.integrity import CHECKSUMS, MANIFEST

_OWN_FIELDS = ("kind", "format_version", "created")


def _fields(manifest: dict) -> dict:
    return {k: v for k, v in manifest.items() if k not in _OWN_FIELDS}


def _write_compact(compact: Path, out_dir: Path, n: int, source: str, fill) -> dict:
    """out_dir = the compact copy at `compact` with rotation and scales linked, codes [n, r] written by
    `fill(codes, old_codes)` and the manifest's n and cache_fingerprint set."""
    manifest = read_manifest(compact, COMPACT_KIND, COMPACT_VERSION)
    link_tree(compact, out_dir, skip=(MANIFEST, CHECKSUMS, "codes.npy"))
    old = np.load(compact / "codes.npy", mmap_mode="r")
    codes = np.lib.format.open_memmap(out_dir / "codes.npy", mode="w+", dtype=np.int8, shape=(n, old.shape[1]))
    fill(codes, old)
    codes.flush()
    del codes
    write_manifest(out_dir, COMPACT_KIND, COMPACT_VERSION, **{**_fields(manifest), "n": n,
                                                              "cache_fingerprint": source})
    return {"rows_before": int(manifest["n"]), "rows_after": n}


def stage_compact_addition(compact: str | os.PathLike, new_rows: np.ndarray, out_dir: str | os.PathLike,
                           source: str) -> dict:
    """The compact scoring copy (W/sr_compact, cfir_jax.search.compact) with `new_rows` [n, D] (the rows appended
    to the image cache, f16/f32) quantised with its stored rotation and scales (values past the scales clip: the
    exact second pass rescores the shortlist), staged in `out_dir`. `source` is the fingerprint retrieve/sr.py
    expects: the staged cache's content_fingerprint. Unlike a rebuild, the rotation stays the one fitted on the
    old rows. Returns {rows_before, rows_after}."""
    compact, out_dir = Path(compact), Path(out_dir)
    rotation, scales = np.load(compact / "rotation.npy"), np.load(compact / "scales.npy")
    if new_rows.ndim != 2 or new_rows.shape[1] != rotation.shape[0]:
        raise StoreError(f"{compact}: rows of dim {rotation.shape[0]}, the new rows are {new_rows.shape}; delete it "
                         "(retrieval rebuilds it)")

    def fill(codes, old):
        codes[: len(old)] = old
        for start in range(0, len(new_rows), 65536):
            block = np.asarray(new_rows[start : start + 65536], np.float32)
            codes[len(old) + start : len(old) + start + len(block)] = quantize_rows(block @ rotation, scales)

    n_old = int(np.load(compact / "codes.npy", mmap_mode="r").shape[0])
    return _write_compact(compact, out_dir, n_old + len(new_rows), source, fill)


def stage_compact_selection(compact: str | os.PathLike, row_map: np.ndarray, out_dir: str | os.PathLike,
                            source: str) -> dict:
    """The compact copy with the rows of a compaction (`stage_cache_compaction`'s row_map: old row -> new row, -1
    dropped), staged in `out_dir`; `source` the compacted cache's content_fingerprint."""
    kept = np.flatnonzero(np.asarray(row_map) >= 0)

    def fill(codes, old):
        for start in range(0, len(kept), 65536):
            codes[start : start + 65536] = old[kept[start : start + 65536]]

    return _write_compact(Path(compact), Path(out_dir), len(kept), source, fill)



def _after_add(change: ChangeRun, out: Path) -> dict:
    old, cache = change.old("image_cache"), change.new("image_cache")
    return stage_compact_addition(change.layout.sr_compact, cache.embeddings[old.num_images:], out,
                                  cache.content_fingerprint)


def _after_compaction(change: ChangeRun, out: Path) -> dict:
    return stage_compact_selection(change.layout.sr_compact, row_map(change), out,
                                   change.new("image_cache").content_fingerprint)


# Both made by retrieval on first use (cfir_jax.retrieve.sr), from the image cache's rows (and the image text's).
_REBUILT = "retrieval rebuilds it on first use"
declare(Stage("sr_compact", reader=Path,
              changes=Changes(add=Step(EXTEND, _after_add), compact=Step(REMAP, _after_compaction))))
declare(Stage("sr_compact_fused", changes=Changes(add=Step(DROP, note=_REBUILT), compact=Step(DROP, note=_REBUILT))))
