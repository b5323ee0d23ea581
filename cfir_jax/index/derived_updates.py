"""The stores aligned with the image cache's rows or the entity index's rows, brought along by a change of the
collection (`cfir_jax.index.collection_update`): image_text (one row per cached image) and entity_text_match (one
list per indexed entity, of cached image rows). Each function writes one complete store into an empty `out` directory
and returns counts; the old store is never touched."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from cfir_jax.data.corpus import Corpus
from cfir_jax.index import entity_text_match
from cfir_jax.index.image_text import image_text
from cfir_jax.index.index_encoder import load_encoder
from cfir_jax.model.tokenizer import resolve_tokenizer
from cfir_jax.stores.contract import manifest_digest, write_manifest
from cfir_jax.stores.entity_index import EntityIndex
from cfir_jax.stores.entity_text_match import FORMAT_VERSION as MATCH_VERSION
from cfir_jax.stores.entity_text_match import KIND as MATCH_KIND
from cfir_jax.stores.entity_text_match import EntityTextMatch
from cfir_jax.stores.image_cache import ImageCache
from cfir_jax.stores.image_text import FORMAT_VERSION as TEXT_VERSION
from cfir_jax.stores.image_text import KIND as TEXT_KIND
from cfir_jax.stores.image_text import ImageTextCache
from cfir_jax.stores.layout import Layout

_BOOKKEEPING = ("kind", "format_version", "created")


def _fields(manifest: dict) -> dict:
    return {k: v for k, v in manifest.items() if k not in _BOOKKEEPING}


def _ids_sha(ids: list[str]) -> str:
    return hashlib.sha256("\n".join(ids).encode()).hexdigest()[:16]


def _write_image_text(out: Path, manifest: dict, embeddings: np.ndarray, has_text: np.ndarray, cache: ImageCache
                      ) -> dict:
    np.save(out / "embeddings.npy", embeddings)
    np.save(out / "has_text.npy", has_text)
    fields = {**_fields(manifest), "cache_fingerprint": cache.content_fingerprint, "num_rows": cache.num_images,
              "num_with_text": int(has_text.sum()), "ids_sha": _ids_sha(cache.ids)}
    write_manifest(out, TEXT_KIND, TEXT_VERSION, **fields)
    return {"rows": cache.num_images, "with_text": int(has_text.sum())}


def image_text_after_add(config, layout: Layout, corpus: Corpus, old_cache: ImageCache, cache: ImageCache,
                         out: Path) -> dict:
    """W/image_text with the new cache rows' texts encoded by the index encoder and appended (the old rows are kept
    as they are: the same text tower embedded them)."""
    # why: flax loads when a model is opened, not on import
    from cfir_jax.model.text_encoder import TextEncoder

    old = ImageTextCache.open(layout.image_text)
    fields = tuple(old.manifest["fields"])
    row_of = {image_id: r for r, image_id in enumerate(corpus.image_ids)}
    texts = [image_text(corpus.image(row_of[i]), fields) for i in cache.ids[old_cache.num_images:]]
    has = np.array([bool(t) for t in texts], bool)
    new = np.zeros((len(texts), old.embeddings.shape[1]), np.float16)
    if has.any():
        it = config.index.image_text
        encoder = TextEncoder(load_encoder(config, layout), resolve_tokenizer(config, corpus),
                              int(old.manifest["max_text_len"]), it.encode_batch)
        new[has] = encoder.encode([t for t in texts if t]).astype(np.float16)
    return _write_image_text(out, old.manifest, np.concatenate([np.asarray(old.embeddings), new]),
                             np.concatenate([old.has_text, has]), cache)


def image_text_after_compaction(layout: Layout, cache: ImageCache, row_map: np.ndarray, out: Path) -> dict:
    """W/image_text without the rows the compaction dropped (row_map [N_old]: the new row, or -1)."""
    old = ImageTextCache.open(layout.image_text)
    keep = np.flatnonzero(row_map >= 0)
    return _write_image_text(out, old.manifest, np.asarray(old.embeddings[keep]), old.has_text[keep], cache)


def entity_text_match_after_add(config, corpus: Corpus, cache: ImageCache, index: EntityIndex, out: Path) -> dict:
    """W/entity_text_match matched again over the union (a pass over the image texts, no model): new images may
    name old entities, and new entities may be named by old images."""
    m = config.index.entity_text_match
    build = out.parent / f"{out.name}.match"  # the builder commits into a directory of its own
    store = entity_text_match.build_entity_text_match(build, corpus, cache, index, fields=tuple(m.fields),
                                                      max_matches=m.max_matches, max_words=m.max_words,
                                                      chunk_rows=m.chunk_rows)
    for child in build.iterdir():
        os.replace(child, out / child.name)
    build.rmdir()
    return {"pairs": int(store.manifest["num_pairs"])}


def entity_text_match_rekeyed(layout: Layout, cache: ImageCache, index: EntityIndex, out: Path, *,
                              keep_entities: np.ndarray | None = None, row_map: np.ndarray | None = None) -> dict:
    """W/entity_text_match following a rewritten entity index: the entity rows it kept (keep_entities [E_old] bool)
    and the image rows a compaction moved (row_map [N_old]: the new row, or -1), recorded against the new builds."""
    old = EntityTextMatch.open(layout.entity_text_match)
    entities = np.flatnonzero(keep_entities) if keep_entities is not None else np.arange(len(old))
    lists = old.rows_of(entities)
    if row_map is not None:
        lists = [row_map[r] for r in lists]
        lists = [r[r >= 0].astype(np.int32) for r in lists]
    offsets = np.zeros(len(lists) + 1, np.int64)
    np.cumsum([len(r) for r in lists], out=offsets[1:])
    rows = np.concatenate(lists).astype(np.int32) if lists else np.zeros(0, np.int32)
    np.save(out / "offsets.npy", offsets)
    np.save(out / "rows.npy", rows)
    fields = {**_fields(old.manifest), "entity_index": manifest_digest(index.manifest),
              "cache_fingerprint": cache.content_fingerprint, "num_entities": len(lists), "num_pairs": int(len(rows)),
              "entities_matched": int((np.diff(offsets) > 0).sum())}
    write_manifest(out, MATCH_KIND, MATCH_VERSION, **fields)
    return {"pairs": int(len(rows))}
