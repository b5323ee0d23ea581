"""Building the image cache with the frozen vision tower: sharded over local devices, split across hosts, resumable."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import numpy as np

from cfir_jax.builders.chunks import shared_work_dir
from cfir_jax.builders.image_import import import_precomputed
from cfir_jax.core import hosts
from cfir_jax.core.errors import CfirError, StoreError
from cfir_jax.core.progress import bar as progress_bar
from cfir_jax.core.progress import shown
from cfir_jax.data.corpus import Corpus
from cfir_jax.model.beit3 import DBeit3
from cfir_jax.model.checkpoint import fingerprint
from cfir_jax.model.image_tower import ImageEncoder, encoder_batch
from cfir_jax.model.preprocess import ImageDecodeError, decode_image
from cfir_jax.stores.atomic_write import save_npy_atomic, write_json_atomic
from cfir_jax.stores.contract import atomic_dir, write_manifest
from cfir_jax.stores.image_cache import (
    FORMAT_VERSION,
    KIND,
    STORAGE_DTYPES,
    ImageCache,
    SkippedImage,
    check_choice,
    digest_ids,
    is_current,
    write_lists,
)

COMPUTE_DTYPES = ("float32", "bfloat16")


# Batches decoded ahead of the device: enough to keep the decode threads busy while the device works.
PREFETCH_BATCHES = 4


log = logging.getLogger(__name__)


def _decode_row(corpus: Corpus, row: int, size: int) -> tuple[str, np.ndarray | None, str]:
    """(image_id, pixels [S, S, 3] or None, reason it was skipped) for one corpus row; runs on a worker thread.
    An image the corpus had removed (`index.py --remove`) is skipped with reason "removed"."""
    if corpus.image_ids[row] in corpus.removed_image_ids:
        return corpus.image_ids[row], None, "removed"
    record = corpus.images[row]
    try:
        return record.image_id, decode_image(record.image, size), ""
    except ImageDecodeError as e:
        return record.image_id, None, str(e)


def _decoded_batches(
    corpus: Corpus, plan: list[tuple[int, list[int]]], size: int, pool: concurrent.futures.Executor
) -> Iterator[tuple[int, list[tuple[str, np.ndarray | None, str]]]]:
    """Yields (shard, decoded rows) for each planned batch, keeping PREFETCH_BATCHES batches in the pool ahead."""
    items = iter(plan)
    queue: collections.deque = collections.deque()

    def submit(item: tuple[int, list[int]]) -> None:
        shard, rows = item
        queue.append((shard, [pool.submit(_decode_row, corpus, r, size) for r in rows]))

    for item in itertools.islice(items, PREFETCH_BATCHES):
        submit(item)
    while queue:
        shard, futures = queue.popleft()
        nxt = next(items, None)
        if nxt is not None:
            submit(nxt)
        yield shard, [f.result() for f in futures]


@dataclasses.dataclass
class _ShardParts:
    """What a shard has accumulated so far: embeddings per batch, ids, skipped images, batches still to come."""

    batches_left: int
    embeddings: list[np.ndarray] = dataclasses.field(default_factory=list)
    ids: list[str] = dataclasses.field(default_factory=list)
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)


def _shard_name(shard: int) -> str:
    return f"shard-{shard:05d}"


def _write_shard(work: Path, shard: int, parts: _ShardParts, dim: int, dtype: str) -> None:
    name = _shard_name(shard)
    emb = np.concatenate(parts.embeddings) if parts.embeddings else np.zeros((0, dim), dtype)
    save_npy_atomic(work / f"{name}.npy", emb.astype(dtype))
    # The json is written last: its presence is what marks the shard complete for a resumed build.
    write_json_atomic(work / f"{name}.json", {"ids": parts.ids, "skipped": parts.skipped})


def _shard_done(work: Path, shard: int) -> bool:
    name = _shard_name(shard)
    return (work / f"{name}.json").is_file() and (work / f"{name}.npy").is_file()


def _encode_shards(
    corpus: Corpus,
    work: Path,
    shards: list[int],
    encoder: ImageEncoder,
    *,
    shard_size: int,
    dtype: str,
    num_workers: int,
    progress: bool,
    on_shard: Callable[[int], None] | None,
) -> None:
    """Encodes the given shards into `work`; the device works on batch b while threads decode batch b+1..."""
    n, bs, size = corpus.num_images, encoder.batch_size, encoder.image_size
    plan: list[tuple[int, list[int]]] = []
    parts: dict[int, _ShardParts] = {}
    for shard in shards:
        rows = list(range(shard * shard_size, min(n, (shard + 1) * shard_size)))
        batches = [rows[i : i + bs] for i in range(0, len(rows), bs)]
        plan += [(shard, b) for b in batches]
        parts[shard] = _ShardParts(batches_left=len(batches))
    bar = progress_bar(total=sum(len(r) for _, r in plan), desc="image cache", unit="img", show=progress)

    def finish(shard: int, ids: list[str], out: jax.Array | None) -> None:
        p = parts[shard]
        if out is not None:
            p.embeddings.append(np.asarray(out)[: len(ids)].astype(dtype))
            p.ids += ids
        p.batches_left -= 1
        if p.batches_left == 0:
            _write_shard(work, shard, p, encoder.dim, dtype)
            del parts[shard]
            if on_shard is not None:
                on_shard(shard)

    in_flight = None
    with concurrent.futures.ThreadPoolExecutor(num_workers, thread_name_prefix="decode") as pool:
        for shard, decoded in _decoded_batches(corpus, plan, size, pool):
            ok = [(image_id, px) for image_id, px, _ in decoded if px is not None]
            parts[shard].skipped += [(image_id, reason) for image_id, px, reason in decoded if px is None]
            out = None
            if ok:
                # A fresh buffer per batch: on CPU, jit may alias a numpy input instead of copying it, and the
                # asynchronous call may still be reading it when the next batch is written.
                pixels = np.zeros((bs, size, size, 3), np.float32)
                # The padding rows are encoded and dropped: one compiled shape for every batch.
                pixels[: len(ok)] = np.stack([px for _, px in ok])
                out = encoder(pixels)  # asynchronous: the device runs while the previous batch is collected
            if in_flight is not None:
                finish(*in_flight)
            in_flight = (shard, [image_id for image_id, _ in ok], out)
            bar.update(len(decoded))
        if in_flight is not None:
            finish(*in_flight)
    bar.close()


def _merge_shards(work: Path, tmp: Path, num_shards: int, dim: int, dtype: str) -> tuple[int, int]:
    """Concatenates the shards of `work` into tmp/{embeddings.npy, ids.txt, skipped.tsv}; returns (encoded, skipped)."""
    metas = [json.loads((work / f"{_shard_name(s)}.json").read_text()) for s in range(num_shards)]
    total = sum(len(m["ids"]) for m in metas)
    out = np.lib.format.open_memmap(tmp / "embeddings.npy", mode="w+", dtype=dtype, shape=(total, dim))
    row = 0
    for s, meta in enumerate(metas):
        emb = np.load(work / f"{_shard_name(s)}.npy", mmap_mode="r")
        if emb.shape != (len(meta["ids"]), dim):
            raise StoreError(f"{work}: {_shard_name(s)}.npy has shape {emb.shape}, expected ({len(meta['ids'])}, "
                             f"{dim}); delete {work} and rebuild")
        out[row : row + len(emb)] = emb
        row += len(emb)
    out.flush()
    del out
    ids = [i for m in metas for i in m["ids"]]
    skipped = [SkippedImage(i, r) for m in metas for i, r in m["skipped"]]
    write_lists(tmp, ids, skipped)
    return total, len(skipped)


def _show_progress(progress: bool | None) -> bool:
    """Whether to show a bar: `progress`, by default whether stderr is a terminal; only process 0 shows one."""
    if progress is None:
        progress = shown()
    return progress and hosts.is_main()


def _check_encode_args(model: DBeit3 | None, compute_dtype: str, batch_size: int, shard_size: int) -> None:
    """One-line errors for a model build without a model, an unknown compute dtype or a non-positive size."""
    if model is None:
        raise CfirError("no model and no precomputed embeddings: pass a model directory, or precomputed='corpus' "
                        "/ a .npy or parquet file of embeddings")
    check_choice("compute_dtype", compute_dtype, COMPUTE_DTYPES)
    if batch_size <= 0 or shard_size <= 0:
        raise CfirError(f"batch_size ({batch_size}) and shard_size ({shard_size}) must be positive")


def _import_cache(
    out_dir: Path,
    corpus: Corpus,
    model: DBeit3 | None,
    precomputed: str | os.PathLike,
    precomputed_ids: str | os.PathLike | None,
    dtype: str,
    allow_missing: bool,
) -> ImageCache:
    """The cache imported from precomputed embeddings (see `build_image_cache`), opened by every process."""
    if model is not None:
        raise CfirError("give either a model or precomputed embeddings, not both")
    # A conversion of files, not model work: process 0 imports while the others wait, then all open it.
    if hosts.is_main():
        import_precomputed(out_dir, corpus, precomputed, precomputed_ids, dtype, allow_missing)
    hosts.barrier("cfir_image_cache_imported")
    return ImageCache.open(out_dir)


def _cache_key(model: DBeit3, corpus: Corpus, dtype: str, compute_dtype: str, shard_size: int) -> dict:
    """What a model-built cache depends on: it names the shared work directory and goes into the manifest."""
    return dict(
        format_version=FORMAT_VERSION,
        fingerprint=fingerprint(model, "vision"),
        dim=int(model.config.embed_dim),
        dtype=dtype,
        compute_dtype=compute_dtype,
        image_size=int(model.config.image_size),
        shard_size=shard_size,
        corpus_images=corpus.num_images,
        corpus_ids_sha=digest_ids(corpus.image_ids),
    )


def _commit_shards(
    out_dir: Path, work: Path, key: dict, num_shards: int, dtype: str, batch_size: int, n_proc: int, start: float
) -> None:
    """Merges every process's shards of `work` into out_dir atomically with its manifest, then removes `work`."""
    missing = [s for s in range(num_shards) if not _shard_done(work, s)]
    if missing:
        raise StoreError(f"{work}: shards {missing[:5]} are missing after every process finished; rerun the build")
    with atomic_dir(out_dir) as tmp:
        encoded, skipped = _merge_shards(work, tmp, num_shards, key["dim"], dtype)
        write_manifest(
            tmp, KIND, FORMAT_VERSION,
            **{k: v for k, v in key.items() if k != "format_version"},
            num_encoded=encoded, num_skipped=skipped, source="model", batch_size=encoder_batch(batch_size),
            processes=n_proc, build_seconds=round(time.time() - start, 3),
        )
    shutil.rmtree(work, ignore_errors=True)
    log.info("%s: %d images encoded, %d skipped in %.1fs", out_dir, encoded, skipped, time.time() - start)


@dataclasses.dataclass(frozen=True)
class EncodeSettings:
    """How a model encodes the images (index.image_cache's keys): `batch_size` images a call (rounded up to a
    multiple of the local device count), `shard_size` images a shard (the unit of resumption), activations in
    `compute_dtype`, `num_workers` decoding threads (None: the cores, at most 32)."""

    batch_size: int = 64
    shard_size: int = 65536
    compute_dtype: str = "float32"
    num_workers: int | None = None

    @classmethod
    def of(cls, section) -> EncodeSettings:
        """The settings of the config section index.image_cache (its decoding threads: the default)."""
        return cls(section.batch_size, section.shard_size, section.compute_dtype)


@dataclasses.dataclass(frozen=True)
class Precomputed:
    """Embeddings imported instead of encoded: `source` is "corpus" (the corpus' own embeddings.npy), a .npy file
    [N, D] with its ids in `ids` (default: `<stem>.ids.txt` or `ids.txt` beside it), or a parquet file (or a
    directory of them) with columns image_id and embedding. Every corpus image must have a row unless
    `allow_missing` (then it is listed as skipped)."""

    source: str | os.PathLike
    ids: str | os.PathLike | None = None
    allow_missing: bool = False


ENCODE_DEFAULTS = EncodeSettings()


def build_image_cache(
    out_dir: str | os.PathLike,
    corpus: Corpus,
    model: DBeit3 | None = None,
    *,
    encoding: EncodeSettings = ENCODE_DEFAULTS,
    precomputed: Precomputed | None = None,
    dtype: str = "float16",
    progress: bool | None = None,
    on_shard: Callable[[int], None] | None = None,
) -> ImageCache:
    """Builds the image cache of `corpus` into `out_dir` and opens it; reuses a complete, current one.

    With `model` (a DBeit3), every image is decoded with the reference preprocessing and encoded by
    `model.encode_image` as `encoding` says; corrupt or empty images are skipped and listed in skipped.tsv. With
    `precomputed`, embeddings are imported instead (`Precomputed`); every id must be a corpus image. Rows are stored
    in `dtype`. `on_shard(shard)` is called after each shard is written (progress hooks; tests inject interruptions
    through it). `progress` defaults to stderr being a terminal.
    """
    batch_size, shard_size, compute_dtype, num_workers = (encoding.batch_size, encoding.shard_size,
                                                          encoding.compute_dtype, encoding.num_workers)
    out_dir = Path(out_dir)
    check_choice("dtype", dtype, STORAGE_DTYPES)
    progress = _show_progress(progress)
    if precomputed is not None:
        return _import_cache(out_dir, corpus, model, precomputed.source, precomputed.ids, dtype,
                             precomputed.allow_missing)
    _check_encode_args(model, compute_dtype, batch_size, shard_size)

    key = _cache_key(model, corpus, dtype, compute_dtype, shard_size)
    # The shard size only shapes the build, not the result; a cache built with another one is still current.
    if is_current(out_dir, {k: v for k, v in key.items() if k not in ("format_version", "shard_size")}):
        if hosts.is_main():
            log.info("%s: image cache is complete and current; nothing to do", out_dir)
        return ImageCache.open(out_dir)

    start = time.time()
    work = shared_work_dir(out_dir, key)
    num_shards = -(-corpus.num_images // shard_size)
    n_proc = hosts.process_count()
    # Contiguous shard ranges per process; a shard on disk is reused whoever wrote it (another process count too).
    todo = [s for s in hosts.contiguous(num_shards) if not _shard_done(work, s)]
    if todo:
        encoder = ImageEncoder(model, compute_dtype, batch_size)
        _encode_shards(corpus, work, todo, encoder, shard_size=shard_size, dtype=dtype,
                       num_workers=num_workers or min(32, os.cpu_count() or 1), progress=progress, on_shard=on_shard)
    hosts.barrier("cfir_image_cache_shards")
    if hosts.is_main():
        _commit_shards(out_dir, work, key, num_shards, dtype, batch_size, n_proc, start)
    hosts.barrier("cfir_image_cache_done")
    return ImageCache.open(out_dir)
