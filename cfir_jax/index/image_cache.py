"""The image embedding cache: every corpus image encoded once by the frozen vision tower (stage 1 of indexing).

CFIR never trains the vision side, so each image is encoded exactly once and every later stage (the entity index,
the SR scorer, training's in-batch negatives) reads this cache instead of the pixels.

Layout of a cache directory (kind "image_cache"):
  embeddings.npy  [N, D] float16 (or float32), L2-normalised rows, memory-mappable with np.load(mmap_mode="r")
  ids.txt         N image ids, line i = row i (corpus order with the skipped images left out)
  skipped.tsv     `image_id<TAB>reason` (with a header line) for every image that could not be encoded
  manifest.json   format version, vision fingerprint, dim, dtype, counts, shard size, image size, build time

Building. Corpus rows are cut into fixed shards of `shard_size` rows. Each shard is decoded on CPU threads
(overlapped with the device, which encodes the previous batch) and encoded in fixed-shape batches sharded over a
1-D mesh ('data') of the local devices; a finished shard is written into a sibling work directory
`.<name>.building/` as `shard-00000.npy` ([<= shard_size, D]) plus `shard-00000.json` (its ids and skipped images,
written last, so it marks the shard complete). An interrupted build keeps its finished shards and resumes after them,
as long as the model, dtypes, shard size and corpus are the same (otherwise the work directory is started over).
When all shards exist the shards are concatenated into the single `embeddings.npy` readers want, inside an
`atomic_dir`, and the work directory is removed.

Several hosts: process p of P encodes the contiguous shard range [p*S/P, (p+1)*S/P) with its own local devices (no
cross-host collective is needed to encode images); the work directory must be on a shared file system. All
processes meet at a barrier once their shards are written, process 0 alone merges the shards and writes the
manifest, and a second barrier makes every process return only after the store is complete.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import itertools
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from cfir_jax.data.corpus import Corpus
from cfir_jax.errors import CfirError
from cfir_jax.progress import bar as progress_bar
from cfir_jax.model.preprocess import ImageDecodeError, decode_image
from cfir_jax.store import (StoreError, atomic_dir, check_manifest, manifest_digest, read_manifest, write_json_atomic,
                            write_manifest)

if TYPE_CHECKING:
    from cfir_jax.model.beit3 import DBeit3

KIND = "image_cache"
FORMAT_VERSION = 1
STORAGE_DTYPES = ("float16", "float32")
COMPUTE_DTYPES = ("float32", "bfloat16")
# Batches decoded ahead of the device: enough to keep the decode threads busy while the device works.
PREFETCH_BATCHES = 4
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SkippedImage:
    """An image left out of the cache and why (empty bytes, undecodable data, no precomputed embedding)."""

    image_id: str
    reason: str


def _digest_ids(ids: Sequence[str]) -> str:
    h = hashlib.sha256()
    for i in ids:
        h.update(i.encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


def _digest_files(paths: Sequence[Path]) -> str:
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()[:16]


def _check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise CfirError(f"{name}={value!r} is not supported; use one of {', '.join(choices)}")


def _is_current(out_dir: Path, expected: dict) -> bool:
    """Whether out_dir already holds a complete cache built with the `expected` manifest fields."""
    try:
        manifest = read_manifest(out_dir, KIND, FORMAT_VERSION)
    except StoreError:
        return False
    return all(manifest.get(k) == v for k, v in expected.items()) and (out_dir / "embeddings.npy").is_file()


# ---------------------------------------------------------------------------------------------------- encoding


def encoder_batch(batch_size: int) -> int:
    """The batch size actually used: `batch_size` rounded up to a multiple of the local device count."""
    n = jax.local_device_count()
    return -(-batch_size // n) * n


# One jitted encode function per model structure (config incl. compute dtype), shared by every build in a process:
# jit caches its compilations per function object, so a second build (another corpus, a resumed run, the fp32/bf16
# pair of the benchmark) does not compile again. The GraphDef holds the ConfigDict (unhashable), so it cannot be a
# static argument; it is closed over instead.
_ENCODE_FNS: dict[str, tuple[object, Callable]] = {}


def _encode_fn(config) -> tuple[object, Callable]:
    """(graphdef, jitted fn(state, pixels [B, S, S, 3]) -> [B, D]) of the model structure described by `config`."""
    from flax import nnx

    from cfir_jax.model import beit3 as model_lib

    key = json.dumps(config.to_dict(), sort_keys=True, default=str)
    if key not in _ENCODE_FNS:
        graphdef, _ = nnx.split(model_lib.abstract_model(config))

        # The batch sharding of `pixels` propagates to the output: each device encodes its slice with replicated
        # parameters, with no collective.
        @jax.jit
        def encode(state, pixels):
            return nnx.merge(graphdef, state).encode_image(pixels)

        _ENCODE_FNS[key] = (graphdef, encode)
    return _ENCODE_FNS[key]


class ImageEncoder:
    """The vision tower for a fixed [batch, S, S, 3] shape, the batch sharded over a 1-D mesh of the local devices."""

    def __init__(self, model: DBeit3, compute_dtype: str, batch_size: int):
        from flax import nnx

        devices = jax.local_devices()
        self.mesh = Mesh(np.array(devices), ("data",))
        self.batch_size = encoder_batch(batch_size)
        self.image_size = int(model.config.image_size)
        self.dim = int(model.config.embed_dim)
        # The compute dtype is a static attribute of the modules, so it lives in the graphdef: take the graphdef of
        # an abstract model built with the wanted dtype and merge it with the real parameters.
        cfg = model.config.copy_and_resolve_references()
        cfg.dtype = compute_dtype
        _, self._fn = _encode_fn(cfg)
        _, state = nnx.split(model)
        self._state = jax.device_put(state, NamedSharding(self.mesh, PartitionSpec()))
        self._data = NamedSharding(self.mesh, PartitionSpec("data"))

    def __call__(self, pixels: np.ndarray) -> jax.Array:
        """pixels [batch_size, S, S, 3] float32 -> [batch_size, D] float32 (dispatched asynchronously)."""
        return self._fn(self._state, jax.device_put(pixels, self._data))


def _decode_row(corpus: Corpus, row: int, size: int) -> tuple[str, np.ndarray | None, str]:
    """(image_id, pixels [S, S, 3] or None, reason it was skipped) for one corpus row; runs on a worker thread."""
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
    tmp = work / f".{name}.npy.tmp"
    with open(tmp, "wb") as f:
        np.save(f, emb.astype(dtype))
    os.replace(tmp, work / f"{name}.npy")
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
    _write_lists(tmp, ids, skipped)
    return total, len(skipped)


def _write_lists(directory: Path, ids: Sequence[str], skipped: Sequence[SkippedImage]) -> None:
    (directory / "ids.txt").write_text("".join(f"{i}\n" for i in ids))
    # A reason is free text from a decoder; tabs and newlines would break the TSV.
    lines = [f"{s.image_id}\t{' '.join(s.reason.split())}\n" for s in skipped]
    (directory / "skipped.tsv").write_text("image_id\treason\n" + "".join(lines))


def process_shards(num_shards: int, process: int, num_processes: int) -> range:
    """The contiguous range of shards that `process` (of `num_processes`) encodes; together they cover all shards."""
    return range(process * num_shards // num_processes, (process + 1) * num_shards // num_processes)


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _prepare_work_dir(work: Path, key: dict) -> None:
    """Keeps the shards of an interrupted build of the same `key`; otherwise starts the work directory over."""
    key_path = work / "build.json"
    if key_path.is_file():
        try:
            if json.loads(key_path.read_text()) == key:
                return
        except (OSError, json.JSONDecodeError):
            pass
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    write_json_atomic(key_path, key)


def build_image_cache(
    out_dir: str | os.PathLike,
    corpus: Corpus,
    model: DBeit3 | None = None,
    *,
    batch_size: int = 64,
    shard_size: int = 65536,
    dtype: str = "float16",
    compute_dtype: str = "float32",
    precomputed: str | os.PathLike | None = None,
    precomputed_ids: str | os.PathLike | None = None,
    allow_missing: bool = False,
    num_workers: int | None = None,
    progress: bool | None = None,
    on_shard: Callable[[int], None] | None = None,
) -> "ImageCache":
    """Builds the image cache of `corpus` into `out_dir` and opens it; reuses a complete, current one.

    With `model` (a DBeit3), every image is decoded with the reference preprocessing and encoded by
    `model.encode_image` in batches of `batch_size` (rounded up to a multiple of the local device count) with
    activations in `compute_dtype`; corrupt or empty images are skipped and listed in skipped.tsv. With
    `precomputed`, embeddings are imported instead: "corpus" (the corpus' own embeddings.npy), a .npy file [N, D]
    with its ids in `precomputed_ids` (default: `<stem>.ids.txt` or `ids.txt` beside it), or a parquet file (or a
    directory of them) with columns image_id and embedding; every id must be a corpus image, and every corpus image
    must have a row unless `allow_missing` (then it is listed as skipped). `on_shard(shard)` is called after each
    shard is written (progress hooks; tests inject interruptions through it). `progress` defaults to stderr being a
    terminal.
    """
    out_dir = Path(out_dir)
    _check_choice("dtype", dtype, STORAGE_DTYPES)
    if progress is None:
        from cfir_jax.progress import shown

        progress = shown()
    progress = progress and jax.process_index() == 0
    if precomputed is not None:
        if model is not None:
            raise CfirError("give either a model or precomputed embeddings, not both")
        return _import_precomputed(out_dir, corpus, precomputed, precomputed_ids, dtype, allow_missing)
    if model is None:
        raise CfirError("no model and no precomputed embeddings: pass a model directory, or precomputed='corpus' "
                        "/ a .npy or parquet file of embeddings")
    _check_choice("compute_dtype", compute_dtype, COMPUTE_DTYPES)
    if batch_size <= 0 or shard_size <= 0:
        raise CfirError(f"batch_size ({batch_size}) and shard_size ({shard_size}) must be positive")

    from cfir_jax.model.checkpoint import fingerprint

    key = dict(
        format_version=FORMAT_VERSION,
        fingerprint=fingerprint(model, "vision"),
        dim=int(model.config.embed_dim),
        dtype=dtype,
        compute_dtype=compute_dtype,
        image_size=int(model.config.image_size),
        shard_size=shard_size,
        corpus_images=corpus.num_images,
        corpus_ids_sha=_digest_ids(corpus.image_ids),
    )
    # The shard size only shapes the build, not the result; a cache built with another one is still current.
    if _is_current(out_dir, {k: v for k, v in key.items() if k not in ("format_version", "shard_size")}):
        if jax.process_index() == 0:
            log.info("%s: image cache is complete and current; nothing to do", out_dir)
        return ImageCache.open(out_dir)

    start = time.time()
    work = out_dir.with_name(f".{out_dir.name}.building")
    if jax.process_index() == 0:
        _prepare_work_dir(work, key)
    _barrier("cfir_image_cache_work_dir")
    num_shards = -(-corpus.num_images // shard_size)
    n_proc = jax.process_count()
    todo = [s for s in process_shards(num_shards, jax.process_index(), n_proc) if not _shard_done(work, s)]
    if todo:
        encoder = ImageEncoder(model, compute_dtype, batch_size)
        _encode_shards(corpus, work, todo, encoder, shard_size=shard_size, dtype=dtype,
                       num_workers=num_workers or min(32, os.cpu_count() or 1), progress=progress, on_shard=on_shard)
    _barrier("cfir_image_cache_shards")
    if jax.process_index() == 0:
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
    _barrier("cfir_image_cache_done")
    return ImageCache.open(out_dir)


# ---------------------------------------------------------------------------------------------------- import


def _npy_source(path: Path, ids_path: Path | None) -> tuple[list[Path], Iterator[tuple[list[str], np.ndarray]]]:
    if ids_path is None:
        for candidate in (path.with_suffix(".ids.txt"), path.parent / "ids.txt"):
            if candidate.is_file():
                ids_path = candidate
                break
        else:
            raise CfirError(f"{path}: no ids file for the embedding rows; write one id per line to "
                            f"{path.with_suffix('.ids.txt')} or pass precomputed_ids")
    if not Path(ids_path).is_file():
        raise CfirError(f"{ids_path}: ids file not found; pass the file with one image id per embedding row")
    try:
        emb = np.load(path, mmap_mode="r")
    except (ValueError, OSError) as e:
        raise CfirError(f"{path}: not a readable .npy array ({e.__class__.__name__}); save it with np.save") from None
    try:
        ids = Path(ids_path).read_text().split()
    except UnicodeDecodeError:
        raise CfirError(f"{ids_path}: not a UTF-8 text file of image ids") from None
    if emb.ndim != 2 or len(ids) != emb.shape[0]:
        raise CfirError(f"{path}: shape {emb.shape} does not match the {len(ids)} ids of {ids_path}; "
                        "expected [num_ids, D]")
    step = 65536
    chunks = ((ids[i : i + step], np.asarray(emb[i : i + step])) for i in range(0, len(ids), step))
    return [path, Path(ids_path)], chunks


def _parquet_source(path: Path) -> tuple[list[Path], Iterator[tuple[list[str], np.ndarray]]]:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
    if not files:
        raise CfirError(f"{path}: no .parquet files in this directory")
    opened = []
    for f in files:
        try:
            pf = pq.ParquetFile(f)
        except (pa.ArrowInvalid, OSError) as e:
            raise CfirError(f"{f}: not a readable parquet file ({e.__class__.__name__})") from None
        names = set(pf.schema_arrow.names)
        if not {"image_id", "embedding"} <= names:
            raise CfirError(f"{f}: needs columns 'image_id' and 'embedding', found {sorted(names)}")
        opened.append((f, pf))

    def chunks() -> Iterator[tuple[list[str], np.ndarray]]:
        for f, pf in opened:
            for batch in pf.iter_batches(batch_size=65536, columns=["image_id", "embedding"]):
                col = batch.column("embedding")
                if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)
                        or pa.types.is_fixed_size_list(col.type)) or col.null_count:
                    raise CfirError(f"{f}: column 'embedding' must hold one non-null list of floats per row "
                                    f"(found {col.type}, {col.null_count} nulls)")
                lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
                if len(lengths) and (lengths != lengths[0]).any():
                    raise CfirError(f"{f}: embeddings of different lengths ({lengths.min()}..{lengths.max()})")
                dim = int(lengths[0]) if len(lengths) else 0
                values = col.flatten().to_numpy(zero_copy_only=False).astype(np.float32)
                yield [str(i) for i in batch.column("image_id").to_pylist()], values.reshape(len(batch), dim)

    return files, chunks()


def _import_precomputed(
    out_dir: Path,
    corpus: Corpus,
    source: str | os.PathLike,
    ids_path: str | os.PathLike | None,
    dtype: str,
    allow_missing: bool,
) -> "ImageCache":
    """Writes a cache from existing embeddings, matched to the corpus by image id (rows follow corpus order)."""
    if str(source) == "corpus":
        emb = corpus.embeddings()
        if emb is None:
            raise CfirError(f"{corpus.path}: the corpus has no precomputed embeddings; pass a model or a .npy/parquet")
        files = [corpus.path / "embeddings.npy"]
        ids, step = corpus.image_ids, 65536
        chunks = ((ids[i : i + step], np.asarray(emb[i : i + step])) for i in range(0, len(ids), step))
    else:
        path = Path(source)
        if not path.exists():
            raise CfirError(f"{path}: precomputed embeddings not found; pass a .npy or .parquet file")
        if path.suffix == ".npy":
            files, chunks = _npy_source(path, Path(ids_path) if ids_path is not None else None)
        elif path.suffix == ".parquet" or path.is_dir():
            files, chunks = _parquet_source(path)
        else:
            raise CfirError(f"{path}: unknown embeddings format; use a .npy (with ids file) or .parquet file")
    fp = f"precomputed:{_digest_files(files)}"
    expected = dict(fingerprint=fp, dtype=dtype, corpus_images=corpus.num_images,
                    corpus_ids_sha=_digest_ids(corpus.image_ids), allow_missing=allow_missing)
    if _is_current(out_dir, expected):
        return ImageCache.open(out_dir)

    start = time.time()
    n = corpus.num_images
    row_of = {image_id: r for r, image_id in enumerate(corpus.image_ids)}
    have = np.zeros(n, bool)
    dim = None
    with atomic_dir(out_dir) as tmp:
        full = None
        for ids, emb in chunks:
            if dim is None:
                dim = int(emb.shape[1])
                if dim == 0:
                    raise CfirError(f"{source}: embeddings have dimension 0")
                full = np.lib.format.open_memmap(tmp / "all_rows.npy", mode="w+", dtype=dtype, shape=(n, dim))
            if emb.shape[1] != dim:
                raise CfirError(f"{source}: embedding dim {emb.shape[1]} differs from the first rows' {dim}")
            if not np.isfinite(emb).all():
                raise CfirError(f"{source}: non-finite values in the embeddings; fix or drop those rows")
            unknown = [i for i in ids if i not in row_of]
            if unknown:
                raise CfirError(f"{source}: {len(unknown)} image ids are not in corpus {corpus.path} (first: "
                                f"{', '.join(map(repr, unknown[:3]))}); use embeddings of this corpus' images")
            rows = np.fromiter((row_of[i] for i in ids), np.int64, len(ids))
            if have[rows].any() or len(np.unique(rows)) != len(rows):
                dup = next(i for i, c in collections.Counter(ids).items() if c > 1 or have[row_of[i]])
                raise CfirError(f"{source}: image id {dup!r} has more than one embedding row; keep one per image")
            full[rows] = emb.astype(dtype)
            have[rows] = True
        if dim is None:
            raise CfirError(f"{source}: no embedding rows")
        missing = np.flatnonzero(~have)
        if len(missing) and not allow_missing:
            raise CfirError(f"{source}: {len(missing)} corpus images have no embedding (first: "
                            f"{', '.join(repr(corpus.image_ids[r]) for r in missing[:3])}); "
                            "add them or pass allow_missing=True to skip them")
        full.flush()
        if len(missing):
            kept = np.flatnonzero(have)
            out = np.lib.format.open_memmap(tmp / "embeddings.npy", mode="w+", dtype=dtype, shape=(len(kept), dim))
            for i in range(0, len(kept), 65536):
                out[i : i + 65536] = full[kept[i : i + 65536]]
            out.flush()
            del out, full
            (tmp / "all_rows.npy").unlink()
        else:
            del full
            os.replace(tmp / "all_rows.npy", tmp / "embeddings.npy")
            kept = np.arange(n)
        ids_kept = [corpus.image_ids[r] for r in kept]
        skipped = [SkippedImage(corpus.image_ids[r], "no precomputed embedding") for r in missing]
        _write_lists(tmp, ids_kept, skipped)
        write_manifest(tmp, KIND, FORMAT_VERSION, **expected, dim=dim, compute_dtype=None, image_size=None,
                       shard_size=None, num_encoded=len(ids_kept), num_skipped=len(skipped),
                       source=os.fspath(source), build_seconds=round(time.time() - start, 3))
    return ImageCache.open(out_dir)


# ---------------------------------------------------------------------------------------------------- reading


class ImageCache:
    """A complete image cache opened for reading: `embeddings` is one memory-mapped [N, D] array, row i = ids[i]."""

    def __init__(self, path: Path, manifest: dict, ids: list[str], embeddings: np.ndarray):
        self.path = path
        self.manifest = manifest
        self.ids = ids
        self.embeddings = embeddings
        self._row_of: dict[str, int] | None = None

    @classmethod
    def open(
        cls, path: str | os.PathLike, expect_fingerprint: str | None = None, expect_dim: int | None = None
    ) -> "ImageCache":
        """Opens a cache; one-line StoreError if it is missing, incomplete, or built by another model or dim."""
        path = Path(path)
        manifest = read_manifest(path, KIND, FORMAT_VERSION)
        expected = {}
        if expect_fingerprint is not None:
            expected["fingerprint"] = expect_fingerprint
        if expect_dim is not None:
            expected["dim"] = int(expect_dim)
        check_manifest(manifest, path, **expected)
        emb_path, ids_path = path / "embeddings.npy", path / "ids.txt"
        if not emb_path.is_file() or not ids_path.is_file():
            raise StoreError(f"{path}: incomplete image cache (no embeddings.npy or ids.txt); rebuild it")
        try:
            embeddings = np.load(emb_path, mmap_mode="r")
        except (ValueError, OSError) as e:
            raise StoreError(f"{emb_path}: unreadable ({e.__class__.__name__}); rebuild the image cache") from None
        ids = ids_path.read_text().split("\n")[:-1]
        want = (manifest.get("num_encoded"), manifest.get("dim"))
        if embeddings.shape != want or len(ids) != want[0] or embeddings.dtype != np.dtype(manifest.get("dtype")):
            raise StoreError(f"{path}: embeddings {embeddings.shape} {embeddings.dtype} and {len(ids)} ids disagree "
                             f"with the manifest ({want}, {manifest.get('dtype')}); rebuild the image cache")
        return cls(path, manifest, ids, embeddings)

    def __repr__(self) -> str:
        return f"ImageCache({self.num_images} x {self.dim} {self.dtype}, {self.fingerprint}, {self.path})"

    @property
    def num_images(self) -> int:
        return len(self.ids)

    @property
    def dim(self) -> int:
        return int(self.manifest["dim"])

    @property
    def dtype(self) -> np.dtype:
        return self.embeddings.dtype

    @property
    def fingerprint(self) -> str:
        """The vision fingerprint of the model that encoded the images, or 'precomputed:<sha>' of imported ones."""
        return self.manifest["fingerprint"]

    @property
    def content_fingerprint(self) -> str:
        """Identifies this build of the cache (model, images, dtype, build time): what derived stores record."""
        return f"cache-{manifest_digest(self.manifest)}"

    def index_of(self, image_id: str) -> int:
        """Row of `image_id`; CfirError if it is not cached (unknown, or skipped at build time)."""
        if self._row_of is None:
            self._row_of = {i: r for r, i in enumerate(self.ids)}
        row = self._row_of.get(image_id)
        if row is None:
            raise CfirError(f"{self.path}: image id {image_id!r} is not in the cache (unknown or skipped, see "
                            "skipped.tsv)")
        return row

    def gather(self, rows: Sequence[int] | np.ndarray) -> np.ndarray:
        """Embeddings of `rows` as float32 [len(rows), D]."""
        rows = np.asarray(rows, np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= self.num_images):
            raise CfirError(f"{self.path}: row out of range [0, {self.num_images})")
        return np.asarray(self.embeddings[rows], np.float32)

    def iter_blocks(self, block_rows: int = 65536) -> Iterator[tuple[int, np.ndarray]]:
        """(first row, float32 [<= block_rows, D]) over the whole cache, for passes that must not load it at once."""
        for start in range(0, self.num_images, block_rows):
            yield start, np.asarray(self.embeddings[start : start + block_rows], np.float32)

    def skipped(self) -> list[SkippedImage]:
        """The images left out at build time, with the reason."""
        lines = (self.path / "skipped.tsv").read_text().splitlines()[1:]
        return [SkippedImage(*line.split("\t", 1)) for line in lines]
