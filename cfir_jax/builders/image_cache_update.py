"""The image cache under changes of the collection: the added corpus rows encoded (or their precomputed embeddings
imported) and appended (`stage_cache_addition`), removed rows masked (`stage_cache_removal`: removed.txt, rows kept),
the cache rewritten without them (`stage_cache_compaction`, with the old row -> new row map). The Full model's own
cache (W/image_cache_full) is masked and compacted alike, and dropped by an add (its tower has not seen the new
images). Each writes one complete cache into an empty staging directory from the old one, which it never modifies.
Both caches are declared here (`cfir_jax.builders.descriptor`), with their stages of index.py (`build_image_cache`,
`build_image_cache_full`)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from cfir_jax.builders import index_encoder
from cfir_jax.builders.descriptor import DROP, EXTEND, MASK, REMAP, Build, Changes, Stage, StageRun, Step, declare
from cfir_jax.builders.image_import import open_source
from cfir_jax.builders.store_update import ChangeRun
from cfir_jax.core.errors import CfirError, StoreError
from cfir_jax.data.corpus import Corpus, Image
from cfir_jax.stores.atomic_write import link_tree, write_json_atomic
from cfir_jax.stores.contract import write_manifest
from cfir_jax.stores.image_cache import KIND as CACHE_KIND
from cfir_jax.stores.image_cache import REMOVAL_FIELDS, REMOVED, ImageCache, SkippedImage, digest_files, digest_ids
from cfir_jax.stores.image_cache import write_lists as write_cache_lists
from cfir_jax.stores.integrity import CHECKSUMS, MANIFEST
from cfir_jax.stores.layout import Layout

# Fields write_manifest sets itself.
_OWN_FIELDS = ("kind", "format_version", "created")


def _write_ids(path: Path, ids: Iterable[str]) -> None:
    path.write_text("".join(f"{i}\n" for i in ids), encoding="utf-8")


def _fields(manifest: dict) -> dict:
    return {k: v for k, v in manifest.items() if k not in _OWN_FIELDS}


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
    from cfir_jax.builders.image_encoding import EncodeSettings, build_image_cache

    model = index_encoder.load_encoder(config, layout)
    part = build_image_cache(work_dir / "image_cache", _NewImages(corpus, first), model,
                             encoding=EncodeSettings.of(ic), dtype=ic.dtype)
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



def _after_add(change: ChangeRun, out: Path) -> dict:
    return stage_cache_addition(change.config, change.layout, change.old("image_cache"), change.new("corpus"), out,
                                change.work)


def _compacted(store: str):
    def run(change: ChangeRun, out: Path) -> dict:
        info, row_map = stage_cache_compaction(change.old(store), out)
        if store == "image_cache":
            change.keep("row_map", row_map)  # what the stores aligned with its rows follow
        return info
    return run


def _masked(store: str):
    def run(change: ChangeRun, out: Path) -> dict:
        return {"rows_removed": stage_cache_removal(change.old(store), out, change.payload.images)["rows_removed"]}
    return run


def build_image_cache(config, layout: Layout, corpus: Corpus) -> ImageCache:
    """The image cache stage: every image encoded once by the frozen vision tower, or precomputed ones imported."""
    # why: flax loads when a stage encodes, not when index.py reads its stage names to parse flags
    from cfir_jax.builders.image_encoding import EncodeSettings, Precomputed
    from cfir_jax.builders.image_encoding import build_image_cache as build

    ic = config.index.image_cache
    if ic.precomputed:
        return build(layout.image_cache, corpus, precomputed=Precomputed(ic.precomputed), dtype=ic.dtype)
    model = index_encoder.load_encoder(config, layout)
    return build(layout.image_cache, corpus, model, encoding=EncodeSettings.of(ic), dtype=ic.dtype)


def _check_dim(run: StageRun, cache: ImageCache) -> None:
    if cache.dim != run.config.model.embed_dim:
        raise CfirError(f"{run.layout.image_cache}: embeddings have dim {cache.dim} but model.embed_dim is "
                        f"{run.config.model.embed_dim}")


def full_cache_wanted(run: StageRun) -> bool:
    """Whether this run builds W/image_cache_full: when W/model_full exists; named alone in --stages without it,
    one line naming the command that trains it."""
    layout = run.layout
    if (layout.model_full / "manifest.json").is_file():
        return True
    if run.stages != run.all_stages:
        raise CfirError(f"{layout.model_full}: no Full model to re-encode the images with; train it first: python "
                        f"train.py --config CONFIG:full --workdir {layout.root}")
    return False


def build_image_cache_full(config, layout: Layout, corpus: Corpus) -> ImageCache:
    """W/image_cache_full: every image encoded by the Full model's own vision tower (the image cache's format and
    checks; its manifest records that tower's vision fingerprint). The model keeps its own sizes (a :full config may
    train at another image size than the index config's)."""
    # why: flax loads when a stage encodes, not when index.py reads its stage names to parse flags
    from cfir_jax.builders.image_encoding import EncodeSettings
    from cfir_jax.builders.image_encoding import build_image_cache as build
    from cfir_jax.model import checkpoint

    ic = config.index.image_cache
    model = checkpoint.load_model(layout.model_full)
    return build(layout.image_cache_full, corpus, model, encoding=EncodeSettings.of(ic), dtype=ic.dtype)


declare(Stage(
    "image_cache", reader=ImageCache.open,
    build=Build(lambda run: build_image_cache(run.config, run.layout, run.opened["corpus"]),
                lambda c: f"{c.num_images:,} x {c.dim} {c.dtype}, "
                f"{c.manifest.get('num_skipped', 0)} skipped", check=_check_dim,
                unselected=lambda run: ImageCache.open(run.layout.image_cache)),
    changes=Changes(add=Step(EXTEND, _after_add), remove=Step(MASK, _masked("image_cache")),
                    compact=Step(REMAP, _compacted("image_cache")))))
declare(Stage(
    "image_cache_full", reader=ImageCache.open,
    build=Build(lambda run: build_image_cache_full(run.config, run.layout, run.opened["corpus"]),
                lambda c: f"{c.num_images:,} x {c.dim} {c.dtype} by W/model_full's vision tower",
                wanted=full_cache_wanted),
    changes=Changes(
        add=Step(DROP, note="the Full model's own cache: rebuild it with python index.py --config CONFIG --workdir W "
                            "--stages image_cache_full"),
        remove=Step(MASK, _masked("image_cache_full")), compact=Step(REMAP, _compacted("image_cache_full")))))


def row_map(change: ChangeRun) -> np.ndarray:
    """A compaction's old row -> new row of the image cache (-1: dropped), int64 [N_old]."""
    return change.kept("row_map")
