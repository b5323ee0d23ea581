"""The entity index under changes of the collection: images added, entities added, images removed, the cache
compacted. Each `stage_*` writes one complete entity index store (the layout `cfir_jax.stores.entity_index`
describes) into an empty directory `out_dir` from the old store, which it never modifies (its files are read, and
the ScaNN tree hard-linked); the change loop (`cfir_jax.builders.collection_update`) writes the checksums and commits.
Declared here (`cfir_jax.builders.descriptor`): the entity index stage of index.py (`build_entity_index`, over
`cfir_jax.builders.entity_index_build`), extended by an add (and by --add-entities), masked and refilled by a removal,
remapped by a compaction. The lists themselves are filled by `cfir_jax.builders.entity_index_lists`.

Exact backend: every list equals a from-scratch `build_entity_index` over the live rows of the new cache (row ids
kept), candidates, order and stored scores bit for bit. A list only ever needs rescoring over a small set: an entity's
top-K over old rows is its old list, so its top-K over old + new rows is the top-K of (old list + new rows); a list
that lost a removed row is searched again over every live row. The rescoring runs `exact_topk` over a `RowSubset`
of the cache with the query and block shapes the scratch build would use (its chunks of `chunk_size` entities,
`query_rows` queries a call, blocks of min(32768, live rows)), since a matmul's bits may depend on its shapes; lists
whose shapes and rows did not change are copied. On a GPU/TPU the scratch build searches on the devices
(`device_sr`): the update then equals it up to float rounding, not bit for bit.

ScaNN backend: lists are rescored exactly over (old list + new rows), so recall can only rise; entities searched
afresh (new ones, lists that lost a removed row) use `search_with_tail`: the stored tree over [0, searcher_rows)
plus exact search over the rows appended since, removed rows filtered. recall@K is measured again on the sample
against exact search over the live rows.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cfir_jax.builders import entity_index_build
from cfir_jax.builders.candidate_search import resolve_backend
from cfir_jax.builders.chunks import current
from cfir_jax.builders.descriptor import EXTEND, MASK, REMAP, Build, Changes, Stage, Step, declare
from cfir_jax.builders.entity_index_build import EntityIndexSettings, check_inputs, indexed_entities, texts_digest
from cfir_jax.builders.entity_index_lists import (
    DEFAULT_CHUNK_SIZE,
    Encode,
    Plan,
    checked,
    holding,
    list_k,
    old_embeddings,
    same_embeddings,
    source_fields,
    stored_scann,
    write_entity_embeddings,
    write_store,
)
from cfir_jax.builders.image_cache_update import row_map
from cfir_jax.builders.index_encoder import check_cache_encoder, entity_encoder, scann_config
from cfir_jax.builders.store_update import ChangeRun
from cfir_jax.core.errors import CfirError
from cfir_jax.core.progress import shown
from cfir_jax.search.knn import ScannConfig, ScannSearcher
from cfir_jax.stores.atomic_write import link_tree
from cfir_jax.stores.contract import write_manifest
from cfir_jax.stores.entities import EntityStore
from cfir_jax.stores.entity_index import KIND, VERSION, EntityIndex
from cfir_jax.stores.layout import Layout


# ------------------------------------------------------------------------------------------------------- the stages
@dataclass(frozen=True)
class StageSettings:
    """What each `stage_*` takes beside its change, as a scratch build would record it.

    entity_embeddings [E, D] (the old index's rows) or encode(texts) are needed only when the index did not keep its
    embeddings (and encode for entities a removal's refill searches again). cache_fingerprint and sources
    (entities_sha, ...) go into the manifest. chunk_size: the build's (index.entity_index.chunk_size; None: the
    manifest's)."""

    entity_embeddings: np.ndarray | None = None
    encode: Encode | None = None
    cache_fingerprint: str | None = None
    sources: dict | None = None
    chunk_size: int | None = None


DEFAULTS = StageSettings()


def stage_images_added(
    index: EntityIndex,
    out_dir: str | os.PathLike,
    images: np.ndarray,
    n_old: int,
    *,
    removed: np.ndarray | None = None,
    settings: StageSettings = DEFAULTS,
) -> dict:
    """Image rows [n_old, N) appended to the cache: every entity's list gains the new rows that beat its K-th.

    images [N, D] f16/f32 (memmap fine): the whole new cache; removed bool [N] or None: rows never listed.
    The stored ScaNN tree is kept over its rows, the appended ones searched exactly (rebuild it with a full build).
    Returns the new manifest, with `added_images` (a count of this change, not written)."""
    entity_embeddings, encode, chunk_size = settings.entity_embeddings, settings.encode, settings.chunk_size
    out_dir, live = checked(index, out_dir, images, removed)
    n = images.shape[0]
    if not 0 <= n_old <= n or n_old != index.manifest["n_images"]:
        raise CfirError(f"n_old={n_old} but {index.directory} indexes {index.manifest['n_images']} rows of a cache of "
                        f"{n}; stage the rows appended since it was built")
    emb = same_embeddings(index, out_dir, entity_embeddings, encode)
    e = len(index)
    n_live = n if live is None else int(live.sum())
    extra = np.arange(n_old, n, dtype=np.int64)
    # Lists holding a row removed since they were made (a removal not staged here) are searched again.
    full = np.zeros(e, bool) if live is None else holding(index, ~live[:n_old])
    plan = Plan(index, emb, np.arange(e, dtype=np.int64), full, extra if live is None else
                 extra[live[n_old:]], live, list_k(index, n_live), chunk_size or int(index.manifest.get(
                     "chunk_size", DEFAULT_CHUNK_SIZE)))
    manifest = write_store(plan, out_dir, images, index.vocab, searcher="link", scann=stored_scann(index),
                            fields=source_fields(settings.cache_fingerprint, settings.sources))
    return manifest | {"added_images": n - n_old}


def stage_entities_added(
    index: EntityIndex,
    out_dir: str | os.PathLike,
    texts: Sequence[str],
    embeddings: np.ndarray,
    images: np.ndarray,
    removed: np.ndarray | None = None,
    *,
    settings: StageSettings = DEFAULTS,
) -> dict:
    """Entities appended to the index (texts already indexed are skipped): each searched over the whole cache
    (removed rows excluded; ScaNN: the tree plus the appended tail), embeddings [E', D] f32 rows of texts.
    Returns the new manifest, with `added_entities` (not written): how many were new (0: out_dir holds a copy)."""
    entity_embeddings, encode, chunk_size = settings.entity_embeddings, settings.encode, settings.chunk_size
    out_dir, live = checked(index, out_dir, images, removed)
    if images.shape[0] != index.manifest["n_images"]:
        raise CfirError(f"{index.directory} indexes {index.manifest['n_images']} images but the cache has "
                        f"{images.shape[0]}; stage the added images first")
    check_inputs(texts, embeddings, images)
    fresh = np.asarray([i for i, t in enumerate(texts) if index.row(t) is None], np.int64)
    old_emb = old_embeddings(index, entity_embeddings, encode)
    emb = write_entity_embeddings(out_dir, [(old_emb, slice(None)), (np.asarray(embeddings, np.float32), fresh)],
                            int(index.manifest["dim"]))
    e_old, e_new = len(index), len(fresh)
    n_live = images.shape[0] if live is None else int(live.sum())
    plan = Plan(index, emb, np.concatenate([np.arange(e_old), np.full(e_new, -1)]).astype(np.int64),
                 np.concatenate([np.zeros(e_old, bool), np.ones(e_new, bool)]), np.zeros(0, np.int64), live,
                 list_k(index, n_live), chunk_size or int(index.manifest.get("chunk_size", DEFAULT_CHUNK_SIZE)))
    all_texts = list(index.vocab) + [texts[i] for i in fresh]
    appended = int(index.manifest.get("appended", 0)) + e_new
    manifest = write_store(plan, out_dir, images, all_texts, searcher="link", scann=stored_scann(index),
                            fields=source_fields(settings.cache_fingerprint, settings.sources) | {"appended": appended})
    return manifest | {"added_entities": e_new}


def stage_images_removed(
    index: EntityIndex,
    out_dir: str | os.PathLike,
    removed: np.ndarray,
    images: np.ndarray,
    *,
    keep_entities: np.ndarray | None = None,
    settings: StageSettings = DEFAULTS,
) -> dict:
    """Removed image rows taken out of every list, each list refilled to K from the next best.

    removed bool [N]: every removed row of the cache (earlier removals included); rows keep their ids. A list that
    held a removed row is searched again over the live rows (exact: equal to a scratch build over the cache minus
    the removed rows; ScaNN: the tree over-fetched and filtered, plus the appended tail). keep_entities bool [E] or
    None: entity rows kept (documents removed: their entities no remaining document names). Returns the new
    manifest, with `removed_images`, `removed_entities` and `refilled_lists` (counts of this change, not written)."""
    entity_embeddings, encode, chunk_size = settings.entity_embeddings, settings.encode, settings.chunk_size
    out_dir, live = checked(index, out_dir, images, removed)
    if images.shape[0] != index.manifest["n_images"]:
        raise CfirError(f"{index.directory} indexes {index.manifest['n_images']} images but the cache has "
                        f"{images.shape[0]}; stage the added images first")
    e = len(index)
    keep = np.ones(e, bool) if keep_entities is None else np.asarray(keep_entities, bool)
    if keep.shape != (e,):
        raise CfirError(f"keep_entities {keep.shape} but {index.directory} holds {e} entities")
    kept = np.flatnonzero(keep)
    dead = np.zeros(images.shape[0], bool) if live is None else ~live
    lengths = np.diff(index.offsets)
    hit = holding(index, dead)
    if keep.all():
        emb = same_embeddings(index, out_dir, entity_embeddings, encode)
    else:
        emb = write_entity_embeddings(out_dir, [(old_embeddings(index, entity_embeddings, encode), kept)],
                                int(index.manifest["dim"]))
    n_live = images.shape[0] - int(dead.sum())
    # A list that was short of K (ScaNN) cannot say it holds everything above its last: searched again as well.
    short = lengths < min(int(index.manifest["k"]), n_live)
    plan = Plan(index, emb, kept, (hit | short)[kept], np.zeros(0, np.int64), live, list_k(index, n_live),
                 chunk_size or int(index.manifest.get("chunk_size", DEFAULT_CHUNK_SIZE)))
    manifest = write_store(plan, out_dir, images, [index.vocab[r] for r in kept], searcher="link",
                           scann=stored_scann(index),
                           fields=source_fields(settings.cache_fingerprint, settings.sources))
    return manifest | {"removed_images": int(dead.sum()), "removed_entities": int(e - len(kept)),
                       "refilled_lists": int(hit[kept].sum())}


def stage_compacted(
    index: EntityIndex,
    out_dir: str | os.PathLike,
    row_map: np.ndarray,
    *,
    images: np.ndarray | None = None,
    cache_fingerprint: str | None = None,
    scann_config: ScannConfig | None = None,
) -> dict:
    """The cache rewritten without its removed rows: row_map int64 [N_old] gives each old row its new row (-1:
    dropped). Candidates are remapped (a list holding a dropped row is refused: stage the removal first); scores and
    embeddings are kept. The ScaNN tree's ids are those of the old rows, so it is rebuilt over `images` (the
    compacted cache [N_new, D]) when given, else dropped (unseen entities are then searched exactly). Returns the
    new manifest, with `dropped_rows` and `searcher` ("rebuilt", "dropped" or "none"; not written)."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir() or any(out_dir.iterdir()):
        raise CfirError(f"{out_dir}: the staging directory must exist and be empty")
    m = index.manifest
    row_map = np.asarray(row_map, np.int64)
    if row_map.shape != (m["n_images"],):
        raise CfirError(f"row_map {row_map.shape} but {index.directory} indexes {m['n_images']} images")
    n_new = int((row_map >= 0).sum())
    kept_rows = row_map[row_map >= 0]
    if not np.array_equal(kept_rows, np.arange(n_new)):
        raise CfirError("row_map must keep the order of the rows it keeps and number them 0..N'-1")
    if images is not None and images.shape[0] != n_new:
        raise CfirError(f"images {images.shape} but row_map keeps {n_new} rows")
    cand = np.lib.format.open_memmap(out_dir / "candidates.npy", mode="w+", dtype=np.int32,
                                     shape=index.candidates_array.shape)
    step = 1 << 22
    for a in range(0, len(cand), step):
        mapped = row_map[np.asarray(index.candidates_array[a : a + step])]
        if (mapped < 0).any():
            raise CfirError(f"{index.directory}: lists still hold removed rows; stage the removal "
                            "(stage_images_removed) before compacting")
        cand[a : a + step] = mapped
    cand.flush()
    del cand
    np.save(out_dir / "offsets.npy", np.asarray(index.offsets, np.int64))
    for name in ("scores.npy", "entity_embeddings.npy"):
        if (index.directory / name).is_file():
            link_tree(index.directory / name, out_dir / name)
    (out_dir / "vocab.json").write_text(json.dumps(list(index.vocab), ensure_ascii=False), encoding="utf-8")
    fields = {key: v for key, v in m.items() if key not in ("kind", "format_version", "created")}
    has_searcher = bool(m.get("has_searcher")) and images is not None
    if has_searcher:
        ScannSearcher.build(images, index.built_k, scann_config).serialize(out_dir / "scann")
    fields.update(n_images=n_new, n_live=n_new, has_searcher=has_searcher, searcher_rows=n_new if has_searcher else 0)
    if cache_fingerprint is not None:
        fields["cache_fingerprint"] = cache_fingerprint
    manifest = write_manifest(out_dir, KIND, VERSION, **fields)
    return manifest | {"dropped_rows": int(m["n_images"] - n_new),
                       "searcher": "rebuilt" if has_searcher else "dropped" if m.get("has_searcher") else "none"}


# ------------------------------------------------------------------------------------------- the change loop's steps
def _encoder(change: ChangeRun) -> Encode:
    """The index encoder's encode(texts), loaded on first use: an index that kept its entity embeddings needs it only
    for new entities."""
    loaded = []

    def encode(texts: Sequence[str]) -> np.ndarray:
        if not loaded:
            loaded.append(entity_encoder(change.config, change.layout, change.new("corpus"))[0])
        return loaded[0].encode(list(texts))

    return encode


def _counts(info: dict, out: Path) -> dict:
    """What a stage returned beyond the manifest it wrote into `out`: its counts."""
    manifest = json.loads((out / "manifest.json").read_text())
    return {k: v for k, v in info.items() if k not in manifest}


def _after_add(change: ChangeRun, out: Path) -> dict:
    """The new images merged into every list, then the new documents' new entities searched over the whole cache;
    recorded as a from-scratch build over the union would record it."""
    config, union, index, cache = change.config, change.new("corpus"), change.old("entity_index"), \
        change.new("image_cache")
    encode = _encoder(change)
    texts = indexed_entities(config, union, change.new("entities"))
    sources = {"documents": config.index.entity_index.documents, "entities_sha": texts_digest(texts)}
    fresh = [t for t in texts if index.row(t) is None]
    removed = cache.removed if cache.num_live < cache.num_images else None
    chunk = int(config.index.entity_index.chunk_size)
    images_out = change.work / "entity_index.images" if fresh else out
    if fresh:
        shutil.rmtree(images_out, ignore_errors=True)
        images_out.mkdir(parents=True)
    settings = StageSettings(encode=encode, cache_fingerprint=cache.content_fingerprint, sources=sources,
                             chunk_size=chunk)
    counts = _counts(stage_images_added(index, images_out, cache.embeddings, change.old("image_cache").num_images,
                                        removed=removed, settings=settings), images_out)
    if fresh:
        sources["cache_fingerprint"] = cache.content_fingerprint
        counts |= _counts(stage_entities_added(EntityIndex.open(images_out), out, fresh, encode(fresh),
                                               cache.embeddings, removed=removed,
                                               settings=StageSettings(sources=sources, chunk_size=chunk)),
                          out)
        shutil.rmtree(images_out, ignore_errors=True)
    return counts


def _after_removal(change: ChangeRun, out: Path) -> dict:
    """Without the removed images (each list refilled from the next best) and without the entities that the removed
    documents alone named (entities added with --add-entities stay)."""
    config, index, cache = change.config, change.old("entity_index"), change.new("image_cache")
    store = change.old("entities")
    texts = indexed_entities(config, change.new("corpus"), store)
    gone = set(indexed_entities(config, change.old("corpus"), store)) - set(texts)
    keep = np.array([t not in gone for t in index.vocab], bool)
    sources = {"documents": config.index.entity_index.documents, "entities_sha": texts_digest(texts)}
    settings = StageSettings(encode=_encoder(change), cache_fingerprint=cache.content_fingerprint, sources=sources,
                             chunk_size=int(config.index.entity_index.chunk_size))
    return _counts(stage_images_removed(index, out, cache.removed, cache.embeddings,
                                        keep_entities=None if keep.all() else keep, settings=settings), out)


def _after_compaction(change: ChangeRun, out: Path) -> dict:
    cache = change.new("image_cache")
    return _counts(stage_compacted(change.old("entity_index"), out, row_map(change), images=cache.embeddings,
                                   cache_fingerprint=cache.content_fingerprint,
                                   scann_config=scann_config(change.config)), out)


def _entities_appended(change: ChangeRun, out: Path) -> dict:
    """--add-entities: the texts of the change's payload (those not indexed yet) searched over the whole cache."""
    cache, texts = change.old("image_cache"), list(change.payload.texts)
    encode = _encoder(change)
    settings = StageSettings(encode=encode, chunk_size=int(change.config.index.entity_index.chunk_size))
    return _counts(stage_entities_added(
        change.old("entity_index"), out, texts, encode(texts), cache.embeddings,
        removed=cache.removed if cache.num_live < cache.num_images else None, settings=settings), out)


def build_entity_index(config, layout: Layout, corpus, entities, cache) -> EntityIndex:
    """The entity index stage: the selected entity texts encoded by the frozen text tower, each one's top-K images
    of this cache, unless current."""
    encoder, fingerprint = entity_encoder(config, layout, corpus)
    check_cache_encoder(config, layout, cache)
    ei = config.index.entity_index
    texts = indexed_entities(config, corpus, entities)
    # What the index is derived from: the selected entity texts and this build of the image cache.
    sources = dict(documents=ei.documents, entities_sha=texts_digest(texts),
                   cache_fingerprint=cache.content_fingerprint)
    # 'auto' (the default): exact on a GPU or TPU, ScaNN on a CPU host. The manifest records the backend used and
    # the setting that chose it; an index is current when it was built with the backend this machine resolves to.
    backend = resolve_backend(ei.backend)
    if current(layout.entity_index, "entity_index", VERSION, model_fingerprint=fingerprint, k_requested=ei.k,
               backend=backend, **sources):
        return EntityIndex.open(layout.entity_index, expect_fingerprint=fingerprint)
    # Each process encodes only the entity texts of the chunks it searches.
    settings = EntityIndexSettings(ei.k, backend=backend, scann_config=scann_config(config),
                                   recall_sample=ei.recall_sample, chunk_size=ei.chunk_size, progress=shown())
    entity_index_build.build_entity_index(layout.entity_index, texts, encoder.encode, cache.embeddings, settings,
                                          model_fingerprint=fingerprint,
                                          sources={**sources, "backend_setting": ei.backend})
    return EntityIndex.open(layout.entity_index, expect_fingerprint=fingerprint)


def _stage(run) -> EntityIndex:
    corpus = run.opened["corpus"]
    entities = run.opened.get("entities") or EntityStore.open(run.layout.entities,
                                                              corpus_fingerprint=corpus.documents_fingerprint)
    return build_entity_index(run.config, run.layout, corpus, entities, run.opened["image_cache"])


declare(Stage(
    "entity_index", reader=EntityIndex.open,
    build=Build(_stage, lambda ix: f"{len(ix):,} entities x K={ix.k}, recall@K {ix.manifest.get('recall_at_k')}"),
    changes=Changes(add=Step(EXTEND, _after_add), remove=Step(MASK, _after_removal),
                    compact=Step(REMAP, _after_compaction), add_entities=Step(EXTEND, _entities_appended))))
