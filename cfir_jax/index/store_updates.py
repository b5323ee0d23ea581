"""New versions of the data stores for one change of the collection (`index.py --add / --remove / --compact`).

Each `stage_*` function writes one complete store into `out_dir`, an empty directory the caller gives (the staging
area of `cfir_jax.stores.versions`), and returns a dict of counts; the store in use is never touched: unchanged
files are hard links of the old ones (copies where links fail), so a reader that has them memory-mapped keeps its
view. Work that is worth keeping across a kill (images encoded, documents through NER or the summariser) goes into
`work_dir`, a directory the caller keeps for the change until it is committed, and is reused by a rerun.

  corpus       stage_corpus_addition: the old corpus plus a part `parts/NNNN/` of the added rows, union id lists,
               qrels and documents digest (cfir_jax.data.corpus); stage_corpus_removal: removed_images.txt and
               removed_documents.txt (union with earlier removals). resolve_removals reads an IDS.txt.
  image_cache  stage_cache_addition: the new corpus rows encoded (or their precomputed embeddings imported) and
               appended; stage_cache_removal: removed.txt, the rows kept; stage_cache_compaction: the cache without
               the removed rows, and the old row -> new row map.
  sr_compact   stage_compact_addition: codes of the appended rows with the stored rotation and scales;
               stage_compact_selection: the rows a compaction keeps. (Retrieval rebuilds a missing copy on demand.)
  entities     stage_entities_addition / stage_summaries_addition: NER or summaries of the new documents only,
  summaries    appended; the result equals a store built over the union in one go (vocabulary in first-mention
               order), recorded against the union corpus' documents fingerprint so the index stages find it current.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import os
import shutil
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from cfir_jax.core.errors import CfirError, StoreError
from cfir_jax.data.corpus import FORMAT_VERSION, KIND, Corpus, Image
from cfir_jax.data.corpus_writer import write_corpus_part, write_split_qrels
from cfir_jax.data.files import IMAGE_SUFFIXES, ROW_FILE_SUFFIXES, read_documents, read_images, read_qrels
from cfir_jax.index.chunks import commit_on_main, iter_chunks
from cfir_jax.index.entities import assemble_entity_store
from cfir_jax.index.image_import import open_source
from cfir_jax.index.summaries import assemble_summary_store, summary_settings
from cfir_jax.search.compact import COMPACT_KIND, COMPACT_VERSION, quantize_rows
from cfir_jax.stores.atomic_write import link_tree, write_json_atomic
from cfir_jax.stores.contract import manifest_digest, read_manifest, write_manifest
from cfir_jax.stores.entities import EntityStore
from cfir_jax.stores.image_cache import KIND as CACHE_KIND
from cfir_jax.stores.image_cache import REMOVAL_FIELDS, REMOVED, ImageCache, SkippedImage, digest_files, digest_ids
from cfir_jax.stores.image_cache import write_lists as write_cache_lists
from cfir_jax.stores.integrity import CHECKSUMS, MANIFEST
from cfir_jax.stores.layout import Layout
from cfir_jax.stores.summaries import SummaryStore

log = logging.getLogger(__name__)
REMOVED_IMAGES, REMOVED_DOCUMENTS = "removed_images.txt", "removed_documents.txt"
# Fields write_manifest sets itself.
_OWN_FIELDS = ("kind", "format_version", "created")


def _write_ids(path: Path, ids: Iterable[str]) -> None:
    path.write_text("".join(f"{i}\n" for i in ids))


def _fields(manifest: dict) -> dict:
    return {k: v for k, v in manifest.items() if k not in _OWN_FIELDS}


def _documents_sha(corpus: Corpus) -> str:
    # A corpus written before the digest existed: its manifest digest, which its documents_fingerprint stands on.
    return corpus.manifest.get("documents_sha") or manifest_digest(corpus.manifest)


# ---------------------------------------------------------------------------------------------------- corpus


@dataclasses.dataclass(frozen=True)
class Addition:
    """What `index.py --add PATH` names: a documents file, an images file or tree, a qrels directory (each or None)."""

    path: Path
    documents: Path | None = None
    images: Path | None = None
    qrels: Path | None = None


def _one_of(root: Path, stem: str) -> Path | None:
    found = [root / f"{stem}{s}" for s in ROW_FILE_SUFFIXES if (root / f"{stem}{s}").is_file()]
    if len(found) > 1:
        raise CfirError(f"{root}: both {found[0].name} and {found[1].name}; keep one {stem} file")
    return found[0] if found else None


def resolve_addition(path: str | os.PathLike) -> Addition:
    """The forms of --add PATH: (a) a directory with documents.jsonl|.parquet and/or images.jsonl|.parquet or an
    images/ tree, and optional qrels/ (with both, the rows file is read: its `path`s point into images/, as in
    examples/collection/); (b) a directory of image files only; (c) a .jsonl/.parquet file of image rows. One line
    when PATH is none of these."""
    path = Path(path)
    if path.is_file():
        if path.suffix not in ROW_FILE_SUFFIXES:
            raise CfirError(f"{path}: --add takes a directory or a .jsonl/.parquet file of image rows")
        return Addition(path, images=path)
    if not path.is_dir():
        raise CfirError(f"{path}: not found; --add takes a directory or a .jsonl/.parquet file of image rows")
    documents, images = _one_of(path, "documents"), _one_of(path, "images")
    if images is None and (path / "images").is_dir():
        images = path / "images"
    qrels = path / "qrels" if (path / "qrels").is_dir() else None
    if documents or images or qrels:
        return Addition(path, documents, images, qrels)
    if any(p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES for p in path.rglob("*")):
        return Addition(path, images=path)
    raise CfirError(f"{path}: nothing to add; give documents.jsonl|.parquet, images.jsonl|.parquet, images/ or "
                    "image files")


def _peek(items: Iterable[Image]) -> tuple[Image | None, Iterator[Image]]:
    it = iter(items)
    first = next(it, None)
    return first, (itertools.chain([first], it) if first is not None else it)


def _check_embeddings(corpus: Corpus, where: Path, first: Image | None) -> None:
    """One line when the added images carry precomputed embeddings and the corpus' do not, or the other way round,
    or of another dim."""
    if first is None:
        return
    have = None if first.embedding is None else int(np.asarray(first.embedding).shape[-1])
    if have == corpus.embedding_dim:
        return
    if have is None:
        raise CfirError(f"{where}: the added images have no 'embedding' but the collection's images carry "
                        f"precomputed embeddings of dim {corpus.embedding_dim}; give every row one")
    if corpus.embedding_dim is None:
        raise CfirError(f"{where}: the added images carry precomputed embeddings but the collection's have none; "
                        "leave the 'embedding' field out")
    raise CfirError(f"{where}: the added embeddings have dim {have} but the collection's have "
                    f"{corpus.embedding_dim}")


def _union_qrels(corpus: Corpus, added: dict, out_dir: Path, doc_ids: Sequence[str], image_ids: Sequence[str],
                 addition: Addition) -> tuple[dict, int]:
    """Writes qrels/<split>.txt of the union (the old judgements, then the added ones); returns (splits, added)."""
    (out_dir / "qrels").mkdir()
    docs, images = set(doc_ids), set(image_ids)
    splits, num_added = {}, 0
    for split in sorted(set(corpus.splits) | set(added), key=("train", "validation", "test").index):
        qrels = corpus.qrels(split) if split in corpus.splits else {}
        for doc_id, judged in added.get(split, {}).items():
            qrels.setdefault(doc_id, {}).update(judged)
            num_added += len(judged)
        label = f"{addition.qrels}: {split} qrels" if split in added else f"{corpus.path}/qrels/{split}.txt"
        topics, judgements, _ = write_split_qrels(out_dir / "qrels" / f"{split}.txt", split, qrels, docs, images,
                                                  False, label)
        old = corpus.manifest["splits"].get(split, {}) if isinstance(corpus.manifest["splits"], dict) else {}
        splits[split] = {"topics": topics, "judgements": judgements, "dropped": int(old.get("dropped", 0))}
    return splits, num_added


def stage_corpus_addition(corpus: Corpus, out_dir: str | os.PathLike, addition: str | os.PathLike) -> dict:
    """The corpus with the rows of `addition` (an --add PATH, `resolve_addition`) appended as a new part, staged in
    `out_dir`. Ids already in the collection are refused in one line naming file:line. Returns the counts:
    documents_added, images_added, judgements_added, first_new_document, first_new_image (the union rows where the
    added ones start) and part."""
    out_dir, add = Path(out_dir), resolve_addition(addition)
    documents = read_documents(add.documents, existing=set(corpus.doc_ids)) if add.documents else iter(())
    first_image, images = _peek(read_images(add.images, existing=set(corpus.image_ids)) if add.images else ())
    _check_embeddings(corpus, add.images or add.path, first_image)
    parts = list(corpus.manifest.get("parts") or [])
    name = f"parts/{len(parts) + 1:04d}"
    link_tree(corpus.path, out_dir, skip=(MANIFEST, CHECKSUMS, "doc_ids.txt", "image_ids.txt", "qrels"))
    part = write_corpus_part(out_dir / name, documents, images, corpus.embedding_dim, source=add.path)
    new_docs = (out_dir / name / "doc_ids.txt").read_text().split("\n")[:-1]
    new_images = (out_dir / name / "image_ids.txt").read_text().split("\n")[:-1]
    doc_ids, image_ids = corpus.doc_ids + new_docs, corpus.image_ids + new_images
    _write_ids(out_dir / "doc_ids.txt", doc_ids)
    _write_ids(out_dir / "image_ids.txt", image_ids)
    splits, judgements = _union_qrels(corpus, read_qrels(add.qrels) if add.qrels else {}, out_dir, doc_ids,
                                      image_ids, add)
    # Chained: the old digest cannot be continued (module docstring of cfir_jax.data.corpus). Images alone keep it.
    sha = _documents_sha(corpus)
    if new_docs:
        sha = hashlib.sha256(f"{sha}\n{part['documents_sha']}".encode()).hexdigest()[:16]
    parts.append({"path": name, "num_documents": len(new_docs), "num_images": len(new_images)})
    write_manifest(out_dir, KIND, FORMAT_VERSION, **{
        **_fields(corpus.manifest), "num_documents": len(doc_ids), "num_images": len(image_ids),
        "documents_sha": sha, "splits": splits, "parts": parts,
        "images_with_text": int(corpus.manifest.get("images_with_text") or 0) + part["images_with_text"]})
    return {"documents_added": len(new_docs), "images_added": len(new_images), "judgements_added": judgements,
            "first_new_document": corpus.num_documents, "first_new_image": corpus.num_images, "part": name}


def resolve_removals(corpus: Corpus, ids_file: str | os.PathLike) -> tuple[list[str], list[str], list[str]]:
    """(image ids, document ids, ids already removed) an IDS.txt names: one id a line, `image:ID` / `document:ID`
    where an id is both; blank lines skipped, repeats counted once. An unknown id, or an id of both kinds without a
    prefix, is one line naming file:line. Already-removed ids come back in the third list (skipped, not errors)."""
    ids_file = Path(ids_file)
    try:
        lines = ids_file.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise CfirError(f"{ids_file}: not found; --remove takes a file of ids, one a line") from None
    except UnicodeDecodeError:
        raise CfirError(f"{ids_file}: not UTF-8 text; --remove takes a file of ids, one a line") from None
    known = {"image": set(corpus.image_ids), "document": set(corpus.doc_ids)}
    removed = {"image": corpus.removed_image_ids, "document": corpus.removed_doc_ids}
    out: dict[str, dict[str, None]] = {"image": {}, "document": {}}  # ordered sets
    already: dict[str, None] = {}
    for n, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line:
            continue
        kind, ident = _kind_of(line, known, f"{ids_file}:{n}")
        if ident in removed[kind]:
            already[ident] = None
        else:
            out[kind][ident] = None
    return list(out["image"]), list(out["document"]), list(already)


def _kind_of(line: str, known: dict[str, set[str]], where: str) -> tuple[str, str]:
    """(kind, id) of one IDS.txt line."""
    for kind in ("image", "document"):
        prefix = f"{kind}:"
        if line.startswith(prefix) and line not in known["image"] and line not in known["document"]:
            ident = line[len(prefix):]
            if ident not in known[kind]:
                article = "an" if kind == "image" else "a"
                raise CfirError(f"{where}: {ident!r} is not {article} {kind} id of the collection")
            return kind, ident
    kinds = [k for k in ("image", "document") if line in known[k]]
    if not kinds:
        raise CfirError(f"{where}: {line!r} is neither an image nor a document id of the collection")
    if len(kinds) == 2:
        raise CfirError(f"{where}: {line!r} is both an image and a document id; write image:{line} or "
                        f"document:{line}")
    return kinds[0], line


def stage_corpus_removal(corpus: Corpus, out_dir: str | os.PathLike, image_ids: Iterable[str],
                         doc_ids: Iterable[str]) -> dict:
    """The corpus with `image_ids` and `doc_ids` added to its removed lists (rows stay), staged in `out_dir`.
    Returns {images_removed, documents_removed} (newly removed), and the totals removed_images, removed_documents."""
    out_dir = Path(out_dir)
    images, docs = set(image_ids), set(doc_ids)
    unknown = sorted((images - set(corpus.image_ids)) | (docs - set(corpus.doc_ids)))
    if unknown:
        raise CfirError(f"{corpus.path}: ids {unknown[:3]} are not in the corpus; resolve them with resolve_removals")
    link_tree(corpus.path, out_dir, skip=(MANIFEST, CHECKSUMS, REMOVED_IMAGES, REMOVED_DOCUMENTS))
    all_images = [i for i in corpus.image_ids if i in images or i in corpus.removed_image_ids]
    all_docs = [d for d in corpus.doc_ids if d in docs or d in corpus.removed_doc_ids]
    _write_ids(out_dir / REMOVED_IMAGES, all_images)
    _write_ids(out_dir / REMOVED_DOCUMENTS, all_docs)
    # documents_sha pinned: the corpus' documents fingerprint (entities, summaries) does not change on a removal.
    write_manifest(out_dir, KIND, FORMAT_VERSION, **{
        **_fields(corpus.manifest), "documents_sha": _documents_sha(corpus), "removed_images": len(all_images),
        "removed_documents": len(all_docs)})
    return {"images_removed": len(all_images) - len(corpus.removed_image_ids),
            "documents_removed": len(all_docs) - len(corpus.removed_doc_ids),
            "removed_images": len(all_images), "removed_documents": len(all_docs)}


# ---------------------------------------------------------------------------------------------------- image cache


class _NewImages:
    """The image rows [first, N) of a corpus, seen as a corpus of their own (what the image-cache build reads)."""

    def __init__(self, corpus: Corpus, first: int):
        self.path = corpus.path
        self._corpus, self._first = corpus, first
        self.image_ids = corpus.image_ids[first:]
        self.num_images = len(self.image_ids)
        self.removed_image_ids = corpus.removed_image_ids
        self.images = self

    def __len__(self) -> int:
        return self.num_images

    def __getitem__(self, row: int) -> Image:
        return self._corpus.images[self._first + int(row)]


def _first_new_image(cache: ImageCache, corpus: Corpus) -> int:
    """The corpus row where the images the cache has not seen start; one line when the cache is of another corpus."""
    first = int(cache.manifest.get("corpus_images") or -1)
    if not 0 <= first <= corpus.num_images or digest_ids(corpus.image_ids[:first]) != cache.manifest.get(
            "corpus_ids_sha"):
        raise StoreError(f"{cache.path}: built from other images than the first rows of {corpus.path}; rebuild it "
                         "with index.py")
    return first


def _write_appended(out_dir: Path, cache: ImageCache, emb: np.ndarray, ids: list[str],
                    skipped: list[SkippedImage], corpus: Corpus, **fields) -> dict:
    """out_dir = the cache with rows `emb` [n, D] (ids `ids`) appended and `skipped` listed: a new embeddings.npy
    (old rows copied in blocks), ids, skipped, the removed list kept; manifest fields updated (`fields` too)."""
    n_old = cache.num_images
    out = np.lib.format.open_memmap(out_dir / "embeddings.npy", mode="w+", dtype=cache.dtype,
                                    shape=(n_old + len(ids), cache.dim))
    for start in range(0, n_old, 65536):
        stop = min(start + 65536, n_old)
        out[start:stop] = cache.embeddings[start:stop]
    out[n_old:] = emb
    out.flush()
    del out
    old_skipped = cache.skipped()
    write_cache_lists(out_dir, cache.ids + ids, old_skipped + skipped)
    if (cache.path / REMOVED).is_file():
        shutil.copyfile(cache.path / REMOVED, out_dir / REMOVED)
    write_manifest(out_dir, CACHE_KIND, cache.VERSION, **{
        **_fields(cache.manifest), "corpus_images": corpus.num_images, "corpus_ids_sha": digest_ids(corpus.image_ids),
        "num_encoded": n_old + len(ids), "num_skipped": len(old_skipped) + len(skipped), **fields})
    return {"images_encoded": len(ids), "images_skipped": len(skipped)}


def _precomputed_rows(cache: ImageCache, corpus: Corpus, first: int, source: str):
    """(embeddings [n, D] in the cache's dtype, ids, skipped, source fingerprint, max row norm) of the corpus rows
    [first, N) from the precomputed `source` the cache was imported from, matched by id."""
    files, chunks = open_source(corpus, source, None)
    want = {image_id: k for k, image_id in enumerate(corpus.image_ids[first:])}
    rows = np.zeros((len(want), cache.dim), cache.dtype)
    have = np.zeros(len(want), bool)
    max_norm = 0.0
    for ids, emb in chunks:
        picked = [(k, want[i]) for k, i in enumerate(ids) if i in want]
        if not picked:
            continue
        if emb.shape[1] != cache.dim:
            raise CfirError(f"{source}: embeddings of dim {emb.shape[1]}, the image cache's are {cache.dim}")
        src, dst = (np.asarray(c) for c in zip(*picked))
        block = np.asarray(emb[src], np.float32)
        if not np.isfinite(block).all():
            raise CfirError(f"{source}: non-finite values in the embeddings; fix or drop those rows")
        rows[dst] = block.astype(cache.dtype)
        have[dst] = True
        max_norm = max(max_norm, float(np.linalg.norm(block, axis=1).max(initial=0.0)))
    new_ids = corpus.image_ids[first:]
    missing = [new_ids[k] for k in np.flatnonzero(~have)]
    if missing and not cache.manifest.get("allow_missing"):
        raise CfirError(f"{source}: {len(missing)} added images have no embedding (first: "
                        f"{', '.join(map(repr, missing[:3]))}); add them to it")
    skipped = [SkippedImage(i, "no precomputed embedding") for i in missing]
    return rows[have], [new_ids[k] for k in np.flatnonzero(have)], skipped, f"precomputed:{digest_files(files)}", \
        max_norm


def stage_cache_addition(config, layout: Layout, cache: ImageCache, corpus: Corpus, out_dir: str | os.PathLike,
                         work_dir: str | os.PathLike) -> dict:
    """The image cache with the corpus rows it has not seen (those of the added part) appended, staged in `out_dir`;
    `corpus` is the union (the staged corpus). As `runner.build_image_cache` builds it: precomputed embeddings
    (index.image_cache.precomputed) imported by id, or the new images encoded by the index encoder, resumably (a
    cache of the new rows alone built in `work_dir/image_cache`, its shards kept across a kill). Same fingerprint,
    dtype and dim; the result's rows equal those of a cache built over the union in one go. Returns
    {images_encoded, images_skipped}."""
    out_dir, work_dir = Path(out_dir), Path(work_dir)
    ic = config.index.image_cache
    first = _first_new_image(cache, corpus)
    if first == corpus.num_images:  # documents alone were added: the cache is current as it is
        link_tree(cache.path, out_dir, skip=(CHECKSUMS,))
        return {"images_encoded": 0, "images_skipped": 0}
    if ic.precomputed:
        emb, ids, skipped, fingerprint, norm = _precomputed_rows(cache, corpus, first, ic.precomputed)
        return _write_appended(out_dir, cache, emb, ids, skipped, corpus, fingerprint=fingerprint,
                               max_row_norm=round(max(norm, float(cache.manifest.get("max_row_norm") or 0.0)), 6))
    # why: flax loads when images are encoded, not when the orchestrator imports this module
    from cfir_jax.index.image_encoding import build_image_cache
    from cfir_jax.index.index_encoder import load_encoder

    model = load_encoder(config, layout)
    part = build_image_cache(work_dir / "image_cache", _NewImages(corpus, first), model, batch_size=ic.batch_size,
                             shard_size=ic.shard_size, dtype=ic.dtype, compute_dtype=ic.compute_dtype)
    for key in ("fingerprint", "dim", "dtype", "compute_dtype", "image_size"):
        if part.manifest.get(key) != cache.manifest.get(key):
            raise StoreError(f"{cache.path}: built with {key}={cache.manifest.get(key)!r} but this run encodes with "
                             f"{part.manifest.get(key)!r}; rebuild the image cache with index.py")
    info = _write_appended(out_dir, cache, np.asarray(part.embeddings), part.ids, part.skipped(), corpus)
    shutil.rmtree(work_dir / "image_cache", ignore_errors=True)
    return info


def stage_cache_removal(cache: ImageCache, out_dir: str | os.PathLike, image_ids: Iterable[str]) -> dict:
    """The cache with the cached ones of `image_ids` added to removed.txt (rows kept; embeddings and ids hard-linked),
    staged in `out_dir`. Its content_fingerprint is unchanged. Returns {rows_removed (new), num_removed (all),
    not_cached (ids the cache skipped at build time)}."""
    out_dir = Path(out_dir)
    ids, in_cache = set(image_ids), set(cache.ids)
    cached = [i for i in ids if i in in_cache]
    link_tree(cache.path, out_dir, skip=(MANIFEST, CHECKSUMS, REMOVED))
    mask = cache.removed.copy()
    mask[[cache.index_of(i) for i in cached]] = True
    removed = [cache.ids[r] for r in np.flatnonzero(mask)]
    _write_ids(out_dir / REMOVED, removed)
    # The manifest as it was (build time included), plus the removal fields: content_fingerprint leaves them out.
    write_json_atomic(out_dir / MANIFEST, {**cache.manifest, "num_removed": len(removed),
                                           "removed_sha": digest_ids(removed)})
    return {"rows_removed": len(removed) - int(cache.removed.sum()), "num_removed": len(removed),
            "not_cached": len(ids) - len(cached)}


def stage_cache_compaction(cache: ImageCache, out_dir: str | os.PathLike) -> tuple[dict, np.ndarray]:
    """The cache without its removed rows (listed in skipped.tsv with reason "removed"), staged in `out_dir`.
    Returns ({rows_before, rows_after}, row_map int64 [rows_before]: the new row of each old row, -1 if removed)."""
    out_dir = Path(out_dir)
    keep = ~cache.removed
    row_map = np.where(keep, np.cumsum(keep) - 1, -1).astype(np.int64)
    kept = np.flatnonzero(keep)
    out = np.lib.format.open_memmap(out_dir / "embeddings.npy", mode="w+", dtype=cache.dtype,
                                    shape=(len(kept), cache.dim))
    for start in range(0, len(kept), 65536):
        out[start : start + 65536] = cache.embeddings[kept[start : start + 65536]]
    out.flush()
    del out
    gone = [SkippedImage(cache.ids[r], "removed") for r in np.flatnonzero(~keep)]
    skipped = cache.skipped() + gone
    write_cache_lists(out_dir, [cache.ids[r] for r in kept], skipped)
    fields = {k: v for k, v in _fields(cache.manifest).items() if k not in REMOVAL_FIELDS}
    write_manifest(out_dir, CACHE_KIND, cache.VERSION, **{**fields, "num_encoded": len(kept),
                                                              "num_skipped": len(skipped)})
    return {"rows_before": cache.num_images, "rows_after": len(kept)}, row_map


# ---------------------------------------------------------------------------------------------------- sr_compact


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


# ---------------------------------------------------------------------------------------------------- documents


def _check_base(store, corpus: Corpus, first_new_doc: int, what: str) -> None:
    if store.doc_ids != corpus.doc_ids[:first_new_doc]:
        raise StoreError(f"{store.directory}: the {what} are not of the first {first_new_doc} documents of "
                         f"{corpus.path}; rebuild them with index.py")


def stage_entities_addition(config, store: EntityStore, corpus: Corpus, first_new_doc: int,
                            out_dir: str | os.PathLike, work_dir: str | os.PathLike) -> dict:
    """The entity store with the NER of the documents [first_new_doc, N) of the union `corpus` appended (chunks kept
    in `work_dir/entities.partial` across a kill), staged in `out_dir`: equal to a store built over the union in one
    go, recorded with the union's documents fingerprint. Returns {documents_added, entities_added}."""
    # why: runner holds the configured extractor and imports the index builders; import it only when used
    from cfir_jax.index.runner import entity_extractor
    from cfir_jax.nlp.entity_sources import categories_of

    out_dir, work_dir = Path(out_dir), Path(work_dir)
    _check_base(store, corpus, first_new_doc, "entities")
    if first_new_doc == corpus.num_documents:  # images alone were added: the store is current as it is
        link_tree(store.directory, out_dir, skip=(CHECKSUMS,))
        return {"documents_added": 0, "entities_added": 0}
    extractor = entity_extractor(config)
    differ = [k for k, v in extractor.settings.items() if store.manifest.get(k) != json.loads(json.dumps(v))]
    if differ:
        raise StoreError(f"{store.directory}: built with other entity settings ({', '.join(differ)}); rebuild it "
                         "with index.py")
    docs = ((corpus.doc_ids[i], extractor.item(doc.text, categories_of(doc)))
            for i in range(first_new_doc, corpus.num_documents) for doc in (corpus.document(i),))
    work = work_dir / "entities"
    chunks = iter_chunks(work, docs, lambda texts: list(extractor.extract(texts)), extractor.settings,
                         config.index.entities.chunk_size, corpus.num_documents - first_new_doc, desc="entities")
    manifest = commit_on_main(out_dir, "entities", chunks, lambda c: assemble_entity_store(
        out_dir, c, extractor, corpus.documents_fingerprint, base=store), work=work)
    return {"documents_added": corpus.num_documents - first_new_doc,
            "entities_added": int(manifest["num_entities"]) - len(store.vocab)}


def stage_summaries_addition(config, store: SummaryStore, corpus: Corpus, first_new_doc: int,
                             out_dir: str | os.PathLike, work_dir: str | os.PathLike) -> dict:
    """The summary store with the summaries of the documents [first_new_doc, N) of the union `corpus` appended
    (chunks kept in `work_dir/summaries.partial`), staged in `out_dir`: equal to a store built over the union in one
    go. Returns {documents_added}."""
    # why: the summarisers (BART) load when documents are summarised, not on import
    from cfir_jax.nlp.summarizer import make_summarizer, summary_input

    out_dir, work_dir = Path(out_dir), Path(work_dir)
    _check_base(store, corpus, first_new_doc, "summaries")
    if first_new_doc == corpus.num_documents:  # images alone were added: the store is current as it is
        link_tree(store.directory, out_dir, skip=(CHECKSUMS,))
        return {"documents_added": 0}
    s = config.index.summaries
    summarizer = make_summarizer(config)
    settings = summary_settings(summarizer, s.fields)
    differ = [k for k, v in settings.items() if store.manifest.get(k) != json.loads(json.dumps(v))]
    if differ:
        raise StoreError(f"{store.directory}: built with other summary settings ({', '.join(differ)}); rebuild it "
                         "with index.py")
    docs = ((corpus.doc_ids[i], summary_input(corpus.document(i), s.fields))
            for i in range(first_new_doc, corpus.num_documents))
    work = work_dir / "summaries"
    chunks = iter_chunks(work, docs, summarizer.summarize, settings, s.chunk_size,
                         corpus.num_documents - first_new_doc, desc="summaries")
    commit_on_main(out_dir, "summaries", chunks, lambda c: assemble_summary_store(
        out_dir, c, settings, corpus.documents_fingerprint, base=store), work=work)
    return {"documents_added": corpus.num_documents - first_new_doc}

