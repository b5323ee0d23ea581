"""The entity index under changes of the collection: images added, entities added, images removed, the cache
compacted. Each `stage_*` writes one complete entity index store (the layout `cfir_jax.stores.entity_index`
describes) into an empty directory `out_dir` from the old store, which it never modifies (its files are read, and
the ScaNN tree hard-linked); the caller (`cfir_jax.index.collection_update`) writes the checksums and commits.

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

import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from cfir_jax.core.errors import CfirError
from cfir_jax.index.entity_index_build import check_inputs, write_csr
from cfir_jax.search.knn import ScannConfig, ScannSearcher, recall_at_k, search_with_tail
from cfir_jax.search.topk import DEFAULT_BLOCK_SIZE, RowSubset, exact_topk, query_rows
from cfir_jax.stores.atomic_write import link_tree
from cfir_jax.stores.contract import write_manifest
from cfir_jax.stores.entity_index import KIND, VERSION, EntityIndex

DEFAULT_CHUNK_SIZE = 4096  # the build's default (index.entity_index.chunk_size); older manifests did not record it
Encode = Callable[[Sequence[str]], np.ndarray]


# ------------------------------------------------------------------------------------------------ entity embeddings
def _old_embeddings(index: EntityIndex, entity_embeddings: np.ndarray | None, encode: Encode | None,
                    chunk: int = 4096) -> np.ndarray:
    """The old index's entity embeddings [E, D] f32: given, stored, or (an index built before they were kept)
    encoded again by `encode` (texts [r] -> [r, D] f32)."""
    e, d = len(index), int(index.manifest["dim"])
    if entity_embeddings is not None:
        if entity_embeddings.shape != (e, d):
            raise CfirError(f"entity_embeddings {entity_embeddings.shape} but {index.directory} holds {e} entities of "
                            f"dim {d}; pass one row per indexed entity")
        return entity_embeddings
    if index.has_embeddings:
        return index.entity_embeddings()
    if encode is None:
        raise CfirError(f"{index.directory}: built without entity_embeddings.npy; pass the index encoder (encode) to "
                        "encode its entities again, or rebuild the index")
    out = np.empty((e, d), np.float32)
    for a in range(0, e, chunk):
        rows = np.asarray(encode(index.vocab[a : a + chunk]), np.float32)
        if rows.shape != (min(e, a + chunk) - a, d):
            raise CfirError(f"the entity encoder gave {rows.shape} for {min(e, a + chunk) - a} texts of dim {d}; "
                            "encode with the index's model")
        out[a : a + chunk] = rows
    return out


def _same_embeddings(index: EntityIndex, out_dir: Path, entity_embeddings: np.ndarray | None, encode: Encode | None
                     ) -> np.ndarray:
    """The new store's entity embeddings when its entities are the old ones: the stored file hard-linked (never
    rewritten), else the given or encoded rows written."""
    if entity_embeddings is None and index.has_embeddings:
        index.entity_embeddings()  # checked before it is linked
        link_tree(index.directory / "entity_embeddings.npy", out_dir / "entity_embeddings.npy")
        return np.load(out_dir / "entity_embeddings.npy", mmap_mode="r")
    old = _old_embeddings(index, entity_embeddings, encode)
    return _write_embeddings(out_dir, [(old, slice(None))], int(index.manifest["dim"]))


def _holding(index: EntityIndex, dead: np.ndarray) -> np.ndarray:
    """bool [E]: the lists that hold a row of dead bool [N] (a running count over the flat candidates)."""
    held = np.concatenate([[0], np.cumsum(dead[np.asarray(index.candidates_array)], dtype=np.int64)])
    return held[index.offsets[1:]] > held[index.offsets[:-1]]


def _write_embeddings(out_dir: Path, parts: Sequence[tuple[np.ndarray, np.ndarray | slice]], dim: int,
                      chunk: int = 65536) -> np.ndarray:
    """Writes out_dir/entity_embeddings.npy f32 [E', D] from (array, rows) parts in order; returns it memory-mapped."""
    sizes = [len(range(*rows.indices(len(a)))) if isinstance(rows, slice) else len(rows) for a, rows in parts]
    path = out_dir / "entity_embeddings.npy"
    emb = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(sum(sizes), dim))
    pos = 0
    for (array, rows), size in zip(parts, sizes):
        idx = np.arange(len(array))[rows] if isinstance(rows, slice) else np.asarray(rows, np.int64)
        for a in range(0, size, chunk):
            emb[pos + a : pos + min(size, a + chunk)] = np.asarray(array[idx[a : a + chunk]], np.float32)
        pos += size
    emb.flush()
    del emb
    return np.load(path, mmap_mode="r")


# ---------------------------------------------------------------------------------------------------- the lists
@dataclasses.dataclass
class _Plan:
    """What the new store's lists are made of. emb [E', D] the new entities' embeddings; old_row int64 [E']: each
    entity's row in the old index (-1: none); full bool [E']: searched over every live row; extra: sorted image rows
    every other list also scores (the added images); live bool [N] or None (all); k: the new K."""

    old: EntityIndex
    emb: np.ndarray
    old_row: np.ndarray
    full: np.ndarray
    extra: np.ndarray
    live: np.ndarray | None
    k: int
    chunk_size: int


def _qb_of(n: int, chunk_size: int) -> np.ndarray:
    """The query block size `query_rows` gives each of n entities in a build by chunks of chunk_size: int64 [n]."""
    qb = np.empty(n, np.int64)
    for a in range(0, n, chunk_size):
        b = min(n, a + chunk_size)
        qb[a:b] = query_rows(b - a)
    return qb


def _copyable(plan: _Plan, n_live: int, old_chunk: int) -> np.ndarray:
    """bool [E']: lists that may be copied as they are: same row, same query block and database block shapes as
    when they were searched, no added rows, not searched again."""
    e = len(plan.old_row)
    old_m = plan.old.manifest
    old_live = int(old_m.get("n_live", old_m["n_images"]))
    if len(plan.extra) or min(DEFAULT_BLOCK_SIZE, old_live) != min(DEFAULT_BLOCK_SIZE, n_live) or \
            old_chunk != plan.chunk_size:
        return np.zeros(e, bool)
    same_row = plan.old_row == np.arange(e)
    qb_old = _qb_of(len(plan.old), plan.chunk_size)
    qb_new = _qb_of(e, plan.chunk_size)
    same_qb = np.zeros(e, bool)
    m = min(e, len(plan.old))
    same_qb[:m] = qb_old[:m] == qb_new[:m]
    return same_row & same_qb & ~plan.full


def _list_of(old: EntityIndex, r: int) -> np.ndarray:
    return np.asarray(old.candidates_array[old.offsets[r] : old.offsets[r + 1]], np.int64)


def _padded(s: np.ndarray, i: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    if i.shape[1] < k:
        s = np.pad(s, ((0, 0), (0, k - i.shape[1])), constant_values=-np.inf)
        i = np.pad(i, ((0, 0), (0, k - i.shape[1])), constant_values=-1)
    return s[:, :k].astype(np.float32), i[:, :k].astype(np.int32)


class _ListSearch:
    """Fills the lists of one query block of entities (see the module docstring); images [N, D] the new cache."""

    def __init__(self, plan: _Plan, images: np.ndarray, scann: ScannSearcher | None):
        self.plan, self.images, self.scann = plan, images, scann
        self.live_rows = None if plan.live is None else np.flatnonzero(plan.live)
        n_live = images.shape[0] if self.live_rows is None else len(self.live_rows)
        self.block = min(DEFAULT_BLOCK_SIZE, n_live)  # the scratch build's block over the live rows
        self.removed = None if plan.live is None else ~plan.live

    def exact(self, q: np.ndarray, rows: np.ndarray | None, qb: int) -> tuple[np.ndarray, np.ndarray]:
        """Exact top-k of q [m, D] over rows (sorted ids; None: every live row) with the scratch build's shapes:
        queries padded to qb, blocks of `self.block` rows."""
        m = len(q)
        qp = np.zeros((qb, q.shape[1]), np.float32)
        qp[:m] = q
        if rows is None:
            rows = self.live_rows
        db = self.images if rows is None else RowSubset(self.images, rows)
        if db.shape[0] == 0:
            return _padded(np.zeros((m, 0), np.float32), np.zeros((m, 0), np.int32), self.plan.k)
        s, i = exact_topk(qp, db, self.plan.k, block_size=self.block, query_block=qb, fixed_block=True)
        s, i = s[:m], i[:m]
        if rows is not None:
            i = rows[i].astype(np.int32)
        return _padded(s, i, self.plan.k)

    def union(self, members: np.ndarray) -> np.ndarray:
        """Sorted live rows of the members' old lists and the added rows."""
        old = self.plan.old
        parts = [_list_of(old, r) for r in self.plan.old_row[members] if r >= 0] + [self.plan.extra]
        rows = np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
        return rows if self.plan.live is None else rows[self.plan.live[rows]]

    def __call__(self, members: np.ndarray, qb: int, backend: str) -> tuple[np.ndarray, np.ndarray]:
        plan = self.plan
        q = np.asarray(plan.emb[members], np.float32)
        full = plan.full[members]
        if backend == "exact":
            # One search for the block, as the scratch build: over everything when any member needs it.
            return self.exact(q, None if full.any() else self.union(members), qb)
        s = np.empty((len(members), plan.k), np.float32)
        i = np.empty((len(members), plan.k), np.int32)
        if (~full).any():
            s[~full], i[~full] = self.exact(q[~full], self.union(members[~full]), query_rows(int((~full).sum())))
        if full.any():
            if self.scann is None:
                s[full], i[full] = self.exact(q[full], None, query_rows(int(full.sum())))
            else:
                s[full], i[full] = search_with_tail(self.scann, self.images, q[full], plan.k, self.removed)
        return s, i


def _fill_lists(plan: _Plan, images: np.ndarray, backend: str, scann: ScannSearcher | None, work: Path,
                copy: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """The padded lists [r, k] (candidates int32, scores f32) of every chunk, saved in `work` and read back
    memory-mapped for `write_csr`."""
    search = _ListSearch(plan, images, scann)
    e, old = len(plan.old_row), plan.old
    work.mkdir()
    blocks = []
    for c, a in enumerate(range(0, e, plan.chunk_size)):
        b = min(e, a + plan.chunk_size)
        qb = query_rows(b - a)
        cand = np.full((b - a, plan.k), -1, np.int32)
        scores = np.full((b - a, plan.k), -np.inf, np.float32)
        for q0 in range(a, b, qb):
            members = np.arange(q0, min(b, q0 + qb))
            if copy[members].all():
                for j in members:
                    o = int(old.offsets[plan.old_row[j]])
                    size = min(plan.k, int(old.offsets[plan.old_row[j] + 1]) - o)
                    cand[j - a, :size] = old.candidates_array[o : o + size]
                    if old.scores_array is not None:
                        scores[j - a, :size] = old.scores_array[o : o + size]
                continue
            s, i = search(members, qb, backend)
            cand[members - a], scores[members - a] = i, s
        np.save(work / f"chunk-{c:06d}.candidates.npy", cand)
        np.save(work / f"chunk-{c:06d}.scores.npy", scores.astype(np.float16))
        blocks.append((np.load(work / f"chunk-{c:06d}.candidates.npy", mmap_mode="r"),
                       np.load(work / f"chunk-{c:06d}.scores.npy", mmap_mode="r")))
    return blocks


def _recall(plan: _Plan, images: np.ndarray, out_dir: Path, sample: int) -> float | None:
    """recall@K of the staged lists against exact search over the live rows, on `sample` entities (seed 0)."""
    e = len(plan.old_row)
    if sample <= 0 or e == 0:
        return None
    rows = np.sort(np.random.default_rng(0).choice(e, min(sample, e), replace=False))
    live = None if plan.live is None else np.flatnonzero(plan.live)
    db = images if live is None else RowSubset(images, live)
    _, exact = exact_topk(np.asarray(plan.emb[rows], np.float32), db, plan.k)
    if live is not None:
        exact = live[exact]
    offsets = np.load(out_dir / "offsets.npy")
    cand = np.load(out_dir / "candidates.npy", mmap_mode="r")
    found = [np.asarray(cand[offsets[r] : offsets[r + 1]]) for r in rows]
    return float(np.mean([recall_at_k(f[None], x[None]) for f, x in zip(found, exact)]))


def _write_store(plan: _Plan, out_dir: Path, images: np.ndarray, texts: Sequence[str], *,
                 searcher: str, scann: ScannSearcher | None, fields: dict) -> dict:
    """Searches/copies every list into out_dir and writes vocab and manifest. searcher: "link" (the old tree, rows
    [0, searcher_rows) unchanged), "none". Returns the manifest."""
    old, m = plan.old, plan.old.manifest
    n = images.shape[0]
    n_live = n if plan.live is None else int(plan.live.sum())
    backend = m["backend"]
    old_chunk = int(m.get("chunk_size", DEFAULT_CHUNK_SIZE))
    work = out_dir / ".lists"
    blocks = _fill_lists(plan, images, backend, scann, work, _copyable(plan, n_live, old_chunk))
    n_candidates = write_csr(out_dir, blocks, bool(m.get("has_scores")))
    del blocks
    shutil.rmtree(work)
    has_searcher = searcher == "link" and bool(m.get("has_searcher"))
    if has_searcher:
        link_tree(old.searcher_dir(), out_dir / "scann")
    (out_dir / "vocab.json").write_text(json.dumps(list(texts), ensure_ascii=False))
    sample = int(m.get("recall_sample") or 256)
    recall = 1.0 if backend == "exact" else _recall(plan, images, out_dir, sample)
    kept = {key: v for key, v in m.items() if key not in ("kind", "format_version", "created", "compacted_from")}
    kept.update(n_images=n, n_live=n_live, k=plan.k, n_entities=len(texts), n_candidates=n_candidates,
                has_embeddings=True, has_searcher=has_searcher, chunk_size=plan.chunk_size, recall_at_k=recall,
                searcher_rows=(old.searcher_rows if has_searcher else 0))
    kept.update(fields)
    return write_manifest(out_dir, KIND, VERSION, **kept)


def _checked(index: EntityIndex, out_dir, images: np.ndarray, removed: np.ndarray | None
             ) -> tuple[Path, np.ndarray | None]:
    out_dir = Path(out_dir)
    if not out_dir.is_dir() or any(out_dir.iterdir()):
        raise CfirError(f"{out_dir}: the staging directory must exist and be empty")
    if images.ndim != 2 or images.shape[1] != index.manifest["dim"]:
        raise CfirError(f"images {images.shape} but {index.directory} is of dim {index.manifest['dim']}")
    if removed is None:
        return out_dir, None
    removed = np.asarray(removed, bool)
    if removed.shape != (images.shape[0],):
        raise CfirError(f"removed mask {removed.shape} but the cache has {images.shape[0]} rows")
    if removed.all():
        raise CfirError("every image row is removed; an entity index needs at least one live image")
    return out_dir, (~removed if removed.any() else None)


def _k(index: EntityIndex, n_live: int) -> int:
    return min(int(index.manifest.get("k_requested", index.built_k)), n_live)


def _scann(index: EntityIndex) -> ScannSearcher | None:
    return ScannSearcher.load(index.searcher_dir()) if index.manifest.get("has_searcher") else None


def _sources(cache_fingerprint: str | None, sources: dict | None) -> dict:
    fields = dict(sources or {})
    if cache_fingerprint is not None:
        fields["cache_fingerprint"] = cache_fingerprint
    return fields


# ------------------------------------------------------------------------------------------------------- the stages
def stage_images_added(
    index: EntityIndex,
    out_dir: str | os.PathLike,
    images: np.ndarray,
    n_old: int,
    *,
    entity_embeddings: np.ndarray | None = None,
    encode: Encode | None = None,
    removed: np.ndarray | None = None,
    cache_fingerprint: str,
    sources: dict | None = None,
    chunk_size: int | None = None,
    scann_config: ScannConfig | None = None,
) -> dict:
    """Image rows [n_old, N) appended to the cache: every entity's list gains the new rows that beat its K-th.

    images [N, D] f16/f32 (memmap fine): the whole new cache; removed bool [N] or None: rows never listed.
    entity_embeddings [E, D] or encode(texts) are needed only when the index did not keep its embeddings.
    cache_fingerprint and sources (entities_sha, ...) go into the manifest as a scratch build records them.
    chunk_size: the build's (index.entity_index.chunk_size; default the manifest's). scann_config is unused: the
    stored tree is kept over its rows, the appended ones searched exactly (rebuild it with a full build).
    Returns the new manifest, with `added_images` (a count of this change, not written)."""
    del scann_config
    out_dir, live = _checked(index, out_dir, images, removed)
    n = images.shape[0]
    if not 0 <= n_old <= n or n_old != index.manifest["n_images"]:
        raise CfirError(f"n_old={n_old} but {index.directory} indexes {index.manifest['n_images']} rows of a cache of "
                        f"{n}; stage the rows appended since it was built")
    emb = _same_embeddings(index, out_dir, entity_embeddings, encode)
    e = len(index)
    n_live = n if live is None else int(live.sum())
    extra = np.arange(n_old, n, dtype=np.int64)
    # Lists holding a row removed since they were made (a removal not staged here) are searched again.
    full = np.zeros(e, bool) if live is None else _holding(index, ~live[:n_old])
    plan = _Plan(index, emb, np.arange(e, dtype=np.int64), full, extra if live is None else
                 extra[live[n_old:]], live, _k(index, n_live), chunk_size or int(index.manifest.get(
                     "chunk_size", DEFAULT_CHUNK_SIZE)))
    manifest = _write_store(plan, out_dir, images, index.vocab, searcher="link", scann=_scann(index),
                            fields=_sources(cache_fingerprint, sources))
    return manifest | {"added_images": n - n_old}


def stage_entities_added(
    index: EntityIndex,
    out_dir: str | os.PathLike,
    texts: Sequence[str],
    embeddings: np.ndarray,
    images: np.ndarray,
    removed: np.ndarray | None = None,
    *,
    entity_embeddings: np.ndarray | None = None,
    encode: Encode | None = None,
    sources: dict | None = None,
    chunk_size: int | None = None,
) -> dict:
    """Entities appended to the index (texts already indexed are skipped): each searched over the whole cache
    (removed rows excluded; ScaNN: the tree plus the appended tail), embeddings [E', D] f32 rows of texts.
    Returns the new manifest, with `added_entities` (not written): how many were new (0: out_dir holds a copy)."""
    out_dir, live = _checked(index, out_dir, images, removed)
    if images.shape[0] != index.manifest["n_images"]:
        raise CfirError(f"{index.directory} indexes {index.manifest['n_images']} images but the cache has "
                        f"{images.shape[0]}; stage the added images first")
    check_inputs(texts, embeddings, images)
    fresh = np.asarray([i for i, t in enumerate(texts) if index.row(t) is None], np.int64)
    old_emb = _old_embeddings(index, entity_embeddings, encode)
    emb = _write_embeddings(out_dir, [(old_emb, slice(None)), (np.asarray(embeddings, np.float32), fresh)],
                            int(index.manifest["dim"]))
    e_old, e_new = len(index), len(fresh)
    n_live = images.shape[0] if live is None else int(live.sum())
    plan = _Plan(index, emb, np.concatenate([np.arange(e_old), np.full(e_new, -1)]).astype(np.int64),
                 np.concatenate([np.zeros(e_old, bool), np.ones(e_new, bool)]), np.zeros(0, np.int64), live,
                 _k(index, n_live), chunk_size or int(index.manifest.get("chunk_size", DEFAULT_CHUNK_SIZE)))
    all_texts = list(index.vocab) + [texts[i] for i in fresh]
    appended = int(index.manifest.get("appended", 0)) + e_new
    manifest = _write_store(plan, out_dir, images, all_texts, searcher="link", scann=_scann(index),
                            fields=dict(sources or {}) | {"appended": appended})
    return manifest | {"added_entities": e_new}


def stage_images_removed(
    index: EntityIndex,
    out_dir: str | os.PathLike,
    removed: np.ndarray,
    images: np.ndarray,
    *,
    entity_embeddings: np.ndarray | None = None,
    encode: Encode | None = None,
    keep_entities: np.ndarray | None = None,
    cache_fingerprint: str | None = None,
    sources: dict | None = None,
    chunk_size: int | None = None,
) -> dict:
    """Removed image rows taken out of every list, each list refilled to K from the next best.

    removed bool [N]: every removed row of the cache (earlier removals included); rows keep their ids. A list that
    held a removed row is searched again over the live rows (exact: equal to a scratch build over the cache minus
    the removed rows; ScaNN: the tree over-fetched and filtered, plus the appended tail). keep_entities bool [E] or
    None: entity rows kept (documents removed: their entities no remaining document names). Returns the new
    manifest, with `removed_images`, `removed_entities` and `refilled_lists` (counts of this change, not written)."""
    out_dir, live = _checked(index, out_dir, images, removed)
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
    hit = _holding(index, dead)
    if keep.all():
        emb = _same_embeddings(index, out_dir, entity_embeddings, encode)
    else:
        emb = _write_embeddings(out_dir, [(_old_embeddings(index, entity_embeddings, encode), kept)],
                                int(index.manifest["dim"]))
    n_live = images.shape[0] - int(dead.sum())
    # A list that was short of K (ScaNN) cannot say it holds everything above its last: searched again as well.
    short = lengths < min(int(index.manifest["k"]), n_live)
    plan = _Plan(index, emb, kept, (hit | short)[kept], np.zeros(0, np.int64), live, _k(index, n_live),
                 chunk_size or int(index.manifest.get("chunk_size", DEFAULT_CHUNK_SIZE)))
    manifest = _write_store(plan, out_dir, images, [index.vocab[r] for r in kept], searcher="link",
                            scann=_scann(index), fields=_sources(cache_fingerprint, sources))
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
    (out_dir / "vocab.json").write_text(json.dumps(list(index.vocab), ensure_ascii=False))
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
