"""Keeping a built collection current: `index.py --add PATH`, `--remove IDS.txt` and `--compact`.

Each is one *change* of the workdir (`cfir_jax.stores.versions`): the new version of every store it touches is staged
under `W/.change/`, then all are committed together and `W/index.json` records the new version and what changed. A
reader (retrieve.py, the service on SIGHUP) sees the old version or the new one, never a mix; a run killed at any
point leaves the old version servable, and the same command run again resumes from the stores already staged.

- add: the new rows become a part of the corpus; the new images are encoded (or imported) and appended to the image
  cache; the new documents' entities and summaries are appended; every indexed entity is scored against the new
  images and its top-K list merged, and the new documents' new entities are searched over the whole cache. With the
  exact backend the entity index is then bit-equal to a from-scratch build over the union.
- remove: the named images are masked (W/image_cache/removed.txt): the entity lists are refilled to K from the next
  best, and every method skips them at query time; removed documents take their entities out of the index when no
  remaining indexed document names them.
- compact: the image cache, the entity index and the stores aligned with the cache's rows are rewritten without
  the removed rows.

The derived stores follow in the same change: image_text (the new rows' texts encoded and appended; rows selected
on compaction), entity_text_match (matched again; re-keyed after a removal; remapped on compaction) and the compact
SR copy W/sr_compact (new rows quantised with its rotation; rows selected on compaction). The fused compact copy is
dropped and rebuilt by retrieval on first use.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from cfir_jax.core.errors import CfirError
from cfir_jax.data.corpus import Corpus
from cfir_jax.index import derived_updates, store_updates
from cfir_jax.index.entity_index_update import (
    stage_compacted,
    stage_entities_added,
    stage_images_added,
    stage_images_removed,
)
from cfir_jax.index.index_encoder import entity_encoder, scann_config
from cfir_jax.index.runner import indexed_entities, texts_digest
from cfir_jax.stores import versions
from cfir_jax.stores.entities import EntityStore
from cfir_jax.stores.entity_index import EntityIndex
from cfir_jax.stores.image_cache import ImageCache
from cfir_jax.stores.layout import Layout
from cfir_jax.stores.summaries import SummaryStore

log = logging.getLogger(__name__)

def _stamp(path: Path) -> list:
    """What identifies the input of an add (its path, and each file's size and time): a rerun with the same input
    resumes the staged change, another input starts over."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return [os.fspath(path.absolute()), [[os.fspath(p.relative_to(path) if path.is_dir() else p.name),
                                          p.stat().st_size, p.stat().st_mtime_ns] for p in files]]


class _Staging:
    """One change's stores: each staged once (a rerun of the same change reuses what an earlier run finished)."""

    def __init__(self, change: versions.Change, say: Callable[[str], None]):
        self.change, self.say, self.changes = change, say, {}
        # Work that survives a kill until the change is committed (encoded shards, NER chunks): resumed by a rerun.
        self.work = change.directory / "work"
        self.work.mkdir(parents=True, exist_ok=True)

    def store(self, name: str, build: Callable[[Path], dict | None]) -> Path:
        done = self.change.staged(name)
        if done is not None:
            self.say(f"  {name}: staged by an earlier run, reused")
            return done
        t0 = time.perf_counter()
        with self.change.stage(name) as tmp:
            info = build(tmp) or {}
        self.say(f"  {name}: {_describe(info)} ({time.perf_counter() - t0:.1f} s)")
        self.changes[name] = info
        return self.change.staged(name)


# What a stage's info says about the change (the rest is its manifest).
_COUNTS = ("documents_added", "images_added", "judgements_added", "images_encoded", "images_skipped",
           "entities_added", "added_images", "added_entities", "images_removed", "documents_removed",
           "rows_removed", "removed_images", "removed_entities", "refilled_lists", "rows_before", "rows_after",
           "dropped_rows", "searcher", "pairs", "rows", "with_text")


def _describe(info: dict) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {v:,}" if isinstance(v, int) else f"{k.replace('_', ' ')} {v}"
                     for k, v in info.items() if k in _COUNTS) or "staged"


def _open(layout: Layout) -> tuple[Corpus, ImageCache, EntityIndex]:
    if not layout.index_json.is_file():
        raise CfirError(f"{layout.root}: no built index here (no index.json); build it with index.py first")
    return Corpus.open(layout.corpus), ImageCache.open(layout.image_cache), EntityIndex.open(layout.entity_index)


# -------------------------------------------------------------------------------------------------------------- add


def add(config, workdir, path: str | os.PathLike, say: Callable[[str], None] = print) -> dict:
    """Appends the documents and images of `path` to the built workdir as one new version; returns what changed."""
    layout, path = Layout.of(workdir), Path(path)
    if not path.exists():
        raise CfirError(f"{path}: nothing to add (no such file or directory)")
    versions.recover(layout)
    corpus, cache, index = _open(layout)
    base = versions.current_version(layout)
    change = versions.begin(layout, "add", {"input": _stamp(path), "base_version": base})
    staging = _Staging(change, say)
    say(f"adding {path} to {layout.root} (version {base})")
    try:  # the input is read and checked here: a refused row leaves nothing staged
        union = Corpus.open(staging.store("corpus", lambda out: store_updates.stage_corpus_addition(
            corpus, out, path)))
    except CfirError:
        change.abandon()
        raise
    new_docs = union.num_documents - corpus.num_documents
    new_cache = ImageCache.open(staging.store("image_cache", lambda out: store_updates.stage_cache_addition(
        config, layout, cache, union, out, staging.work)))
    entities = EntityStore.open(layout.entities)
    if new_docs:
        entities = EntityStore.open(staging.store("entities", lambda out: store_updates.stage_entities_addition(
            config, entities, union, corpus.num_documents, out, staging.work)))
        if (layout.summaries / "manifest.json").is_file():
            staging.store("summaries", lambda out: store_updates.stage_summaries_addition(
                config, SummaryStore.open(layout.summaries), union, corpus.num_documents, out, staging.work))
    new_index = EntityIndex.open(staging.store("entity_index", lambda out: _index_after_add(
        config, layout, union, entities, index, new_cache, cache.num_images, out, staging.work)))
    _derived_after_add(config, layout, staging, union, cache, new_cache, new_index)
    changes = {"images_added": new_cache.num_images - cache.num_images,
               "images_skipped": len(new_cache.skipped()) - len(cache.skipped()),
               "documents_added": new_docs, "entities_added": len(new_index) - len(index)}
    version = change.commit(changes)
    say(f"version {version}: " + ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in changes.items()))
    return {"version": version, **changes}


def _lazy_encoder(config, layout: Layout, corpus: Corpus) -> Callable[[list[str]], np.ndarray]:
    """The index encoder's encode(texts), loaded on first use: an index that kept its entity embeddings needs it only
    for new entities."""
    loaded = []

    def encode(texts: list[str]) -> np.ndarray:
        if not loaded:
            loaded.append(entity_encoder(config, layout, corpus)[0])
        return loaded[0].encode(texts)

    return encode


def _index_after_add(config, layout: Layout, union: Corpus, entities: EntityStore, index: EntityIndex,
                     cache: ImageCache, n_old: int, out: Path, work: Path) -> dict:
    """The entity index after an add: the new images merged into every list, then the new documents' new entities
    searched over the whole cache; recorded as a from-scratch build over the union would record it."""
    encode = _lazy_encoder(config, layout, union)
    texts = indexed_entities(config, union, entities)
    sources = {"documents": config.index.entity_index.documents, "entities_sha": texts_digest(texts)}
    fresh = [t for t in texts if index.row(t) is None]
    removed = cache.removed if cache.num_live < cache.num_images else None
    chunk = int(config.index.entity_index.chunk_size)
    images_out = work / "entity_index.images" if fresh else out
    if fresh:
        shutil.rmtree(images_out, ignore_errors=True)
        images_out.mkdir(parents=True)
    info = stage_images_added(index, images_out, cache.embeddings, n_old, encode=encode, removed=removed,
                              cache_fingerprint=cache.content_fingerprint, sources=sources, chunk_size=chunk)
    if fresh:
        merged = EntityIndex.open(images_out)
        info = stage_entities_added(merged, out, fresh, encode(fresh), cache.embeddings, removed=removed,
                                    sources={**sources, "cache_fingerprint": cache.content_fingerprint},
                                    chunk_size=chunk)
        shutil.rmtree(images_out, ignore_errors=True)
    return info


def _derived_after_add(config, layout: Layout, staging: _Staging, union: Corpus, old_cache: ImageCache,
                       cache: ImageCache, index: EntityIndex) -> None:
    """image_text: the new rows' texts encoded and appended; entity_text_match: matched again over the union; the
    compact SR copy: the new rows quantised with its rotation (the fused one is dropped: retrieval rebuilds it)."""
    if (layout.image_text / "manifest.json").is_file():
        staging.store("image_text", lambda out: derived_updates.image_text_after_add(
            config, layout, union, old_cache, cache, out))
    if (layout.entity_text_match / "manifest.json").is_file():
        staging.store("entity_text_match", lambda out: derived_updates.entity_text_match_after_add(
            config, union, cache, index, out))
    if (layout.sr_compact / "manifest.json").is_file():
        staging.store("sr_compact", lambda out: store_updates.stage_compact_addition(
            layout.sr_compact, cache.embeddings[old_cache.num_images:], out, cache.content_fingerprint))
    if layout.sr_compact_fused.exists():
        staging.change.drop("sr_compact_fused")
    if (layout.image_cache_full / "manifest.json").is_file():  # the Full model's tower has not seen the new images
        staging.change.drop("image_cache_full")
        staging.say(f"  image_cache_full: dropped (the Full model's own cache); rebuild it with python index.py "
                    f"--config CONFIG --workdir {layout.root} --stages image_cache_full")


# ----------------------------------------------------------------------------------------------------------- remove


def remove(config, workdir, ids_file: str | os.PathLike, say: Callable[[str], None] = print) -> dict:
    """Masks the images and documents named in `ids_file` as one new version; returns what changed."""
    layout, ids_file = Layout.of(workdir), Path(ids_file)
    versions.recover(layout)
    corpus, cache, index = _open(layout)
    images, documents, already = store_updates.resolve_removals(corpus, ids_file)
    if not images and not documents:
        say(f"nothing to remove: the {len(already)} ids of {ids_file} are removed already")
        return {"version": versions.current_version(layout), "images_removed": 0, "documents_removed": 0}
    base = versions.current_version(layout)
    change = versions.begin(layout, "remove", {"images": sorted(images), "documents": sorted(documents),
                                               "base_version": base})
    staging = _Staging(change, say)
    say(f"removing {len(images):,} images and {len(documents):,} documents from {layout.root} (version {base})")
    union = Corpus.open(staging.store("corpus", lambda out: store_updates.stage_corpus_removal(
        corpus, out, images, documents)))
    new_cache = ImageCache.open(staging.store("image_cache", lambda out: store_updates.stage_cache_removal(
        cache, out, images)))
    new_index = EntityIndex.open(staging.store("entity_index", lambda out: _index_after_remove(
        config, layout, union, index, new_cache, out, corpus)))
    if (layout.image_cache_full / "manifest.json").is_file():  # the Full model's own cache masks them too
        staging.store("image_cache_full", lambda out: store_updates.stage_cache_removal(
            ImageCache.open(layout.image_cache_full), out, images))
    if (layout.entity_text_match / "manifest.json").is_file():
        staging.store("entity_text_match", lambda out: derived_updates.entity_text_match_rekeyed(
            layout, new_cache, new_index, out, keep_entities=_kept_entities(index, new_index)))
    changes = {"images_removed": len(images), "documents_removed": len(documents),
               "entities_dropped": len(index) - len(new_index), "images_live": new_cache.num_live}
    version = change.commit(changes)
    say(f"version {version}: " + ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in changes.items()))
    return {"version": version, **changes}


def _kept_entities(old: EntityIndex, new: EntityIndex) -> np.ndarray:
    """Which rows of the old entity index the new one kept (a removal only drops rows, never reorders them)."""
    kept = set(new.vocab)
    return np.array([t in kept for t in old.vocab], bool)


def _index_after_remove(config, layout: Layout, corpus: Corpus, index: EntityIndex, cache: ImageCache,
                        out: Path, before: Corpus) -> dict:
    """The entity index without the removed images (each list refilled from the next best) and without the entities
    that the removed documents alone named (entities added with --add-entities stay)."""
    encode = _lazy_encoder(config, layout, corpus)
    store = EntityStore.open(layout.entities)
    texts = indexed_entities(config, corpus, store)
    gone = set(indexed_entities(config, before, store)) - set(texts)
    keep = np.array([t not in gone for t in index.vocab], bool)
    sources = {"documents": config.index.entity_index.documents, "entities_sha": texts_digest(texts)}
    return stage_images_removed(index, out, cache.removed, cache.embeddings, encode=encode,
                                keep_entities=None if keep.all() else keep, cache_fingerprint=cache.content_fingerprint,
                                sources=sources, chunk_size=int(config.index.entity_index.chunk_size))


# ---------------------------------------------------------------------------------------------------------- compact


def compact(config, workdir, say: Callable[[str], None] = print) -> dict:
    """Rewrites the stores without the removed image rows as one new version; returns what changed."""
    layout = Layout.of(workdir)
    versions.recover(layout)
    _, cache, index = _open(layout)
    removed = int(cache.manifest.get("num_removed", 0))
    if not removed:
        say(f"nothing to compact: {layout.image_cache} has no removed rows")
        return {"version": versions.current_version(layout), "rows_dropped": 0}
    base = versions.current_version(layout)
    change = versions.begin(layout, "compact", {"removed_sha": cache.manifest.get("removed_sha"),
                                                "base_version": base})
    staging = _Staging(change, say)
    row_map_file = staging.work / "row_map.npy"

    def compact_cache(out: Path) -> dict:
        info, row_map = store_updates.stage_cache_compaction(cache, out)
        np.save(row_map_file, row_map)
        return info

    new_cache = ImageCache.open(staging.store("image_cache", compact_cache))
    row_map = np.load(row_map_file)
    staging.store("entity_index", lambda out: stage_compacted(
        index, out, row_map, images=new_cache.embeddings, cache_fingerprint=new_cache.content_fingerprint,
        scann_config=scann_config(config)))
    if (layout.image_text / "manifest.json").is_file():
        staging.store("image_text", lambda out: derived_updates.image_text_after_compaction(
            layout, new_cache, row_map, out))
    if (layout.entity_text_match / "manifest.json").is_file():
        staging.store("entity_text_match", lambda out: derived_updates.entity_text_match_rekeyed(
            layout, new_cache, EntityIndex.open(change.staged("entity_index")), out, row_map=row_map))
    if (layout.sr_compact / "manifest.json").is_file():
        staging.store("sr_compact", lambda out: store_updates.stage_compact_selection(
            layout.sr_compact, row_map, out, new_cache.content_fingerprint))
    if layout.sr_compact_fused.exists():
        change.drop("sr_compact_fused")
    if (layout.image_cache_full / "manifest.json").is_file():
        staging.store("image_cache_full", lambda out: store_updates.stage_cache_compaction(
            ImageCache.open(layout.image_cache_full), out)[0])
    changes = {"rows_dropped": removed, "images_live": new_cache.num_images}
    version = change.commit(changes)
    say(f"version {version}: " + ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in changes.items()))
    return {"version": version, **changes}
