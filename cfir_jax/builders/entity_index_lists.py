"""The lists of an entity index under a change (`cfir_jax.builders.entity_index_update`): which lists are copied and
which are searched again, and over which rows, with the shapes a from-scratch build would use (the module docstring
of entity_index_update says why); the old index's entity embeddings (stored, given, or encoded again); and the new
store written from them (`write_store`)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from cfir_jax.builders.entity_index_build import write_csr
from cfir_jax.core.errors import CfirError
from cfir_jax.search.knn import ScannSearcher, recall_at_k, search_with_tail
from cfir_jax.search.topk import DEFAULT_BLOCK_SIZE, RowSubset, exact_topk, query_rows
from cfir_jax.stores.atomic_write import link_tree
from cfir_jax.stores.contract import write_manifest
from cfir_jax.stores.entity_index import KIND, VERSION, EntityIndex

DEFAULT_CHUNK_SIZE = 4096  # the build's default (index.entity_index.chunk_size); older manifests did not record it
Encode = Callable[[Sequence[str]], np.ndarray]


# ------------------------------------------------------------------------------------------------ entity embeddings
def old_embeddings(index: EntityIndex, entity_embeddings: np.ndarray | None, encode: Encode | None,
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


def same_embeddings(index: EntityIndex, out_dir: Path, entity_embeddings: np.ndarray | None, encode: Encode | None
                     ) -> np.ndarray:
    """The new store's entity embeddings when its entities are the old ones: the stored file hard-linked (never
    rewritten), else the given or encoded rows written."""
    if entity_embeddings is None and index.has_embeddings:
        index.entity_embeddings()  # checked before it is linked
        link_tree(index.directory / "entity_embeddings.npy", out_dir / "entity_embeddings.npy")
        return np.load(out_dir / "entity_embeddings.npy", mmap_mode="r")
    old = old_embeddings(index, entity_embeddings, encode)
    return write_entity_embeddings(out_dir, [(old, slice(None))], int(index.manifest["dim"]))


def holding(index: EntityIndex, dead: np.ndarray) -> np.ndarray:
    """bool [E]: the lists that hold a row of dead bool [N] (a running count over the flat candidates)."""
    held = np.concatenate([[0], np.cumsum(dead[np.asarray(index.candidates_array)], dtype=np.int64)])
    return held[index.offsets[1:]] > held[index.offsets[:-1]]


def write_entity_embeddings(out_dir: Path, parts: Sequence[tuple[np.ndarray, np.ndarray | slice]], dim: int,
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
class Plan:
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


def _copyable(plan: Plan, n_live: int, old_chunk: int) -> np.ndarray:
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

    def __init__(self, plan: Plan, images: np.ndarray, scann: ScannSearcher | None):
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


def _fill_lists(plan: Plan, images: np.ndarray, backend: str, scann: ScannSearcher | None, work: Path,
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


def _recall(plan: Plan, images: np.ndarray, out_dir: Path, sample: int) -> float | None:
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


def write_store(plan: Plan, out_dir: Path, images: np.ndarray, texts: Sequence[str], *,
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
    (out_dir / "vocab.json").write_text(json.dumps(list(texts), ensure_ascii=False), encoding="utf-8")
    sample = int(m.get("recall_sample") or 256)
    recall = 1.0 if backend == "exact" else _recall(plan, images, out_dir, sample)
    kept = {key: v for key, v in m.items() if key not in ("kind", "format_version", "created", "compacted_from")}
    kept.update(n_images=n, n_live=n_live, k=plan.k, n_entities=len(texts), n_candidates=n_candidates,
                has_embeddings=True, has_searcher=has_searcher, chunk_size=plan.chunk_size, recall_at_k=recall,
                searcher_rows=(old.searcher_rows if has_searcher else 0))
    kept.update(fields)
    return write_manifest(out_dir, KIND, VERSION, **kept)


def checked(index: EntityIndex, out_dir, images: np.ndarray, removed: np.ndarray | None
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


def list_k(index: EntityIndex, n_live: int) -> int:
    return min(int(index.manifest.get("k_requested", index.built_k)), n_live)


def stored_scann(index: EntityIndex) -> ScannSearcher | None:
    return ScannSearcher.load(index.searcher_dir()) if index.manifest.get("has_searcher") else None


def source_fields(cache_fingerprint: str | None, sources: dict | None) -> dict:
    fields = dict(sources or {})
    if cache_fingerprint is not None:
        fields["cache_fingerprint"] = cache_fingerprint
    return fields

