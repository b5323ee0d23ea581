"""Importing precomputed image embeddings (an .npy with its ids, or parquet) as an image cache, in blocks."""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from cfir_jax.core.errors import CfirError
from cfir_jax.data.corpus import Corpus
from cfir_jax.stores.contract import atomic_dir, write_manifest
from cfir_jax.stores.image_cache import (
    FORMAT_VERSION,
    KIND,
    ImageCache,
    SkippedImage,
    digest_files,
    digest_ids,
    is_current,
    write_lists,
)


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
        ids = Path(ids_path).read_text(encoding="utf-8").split()
    except UnicodeDecodeError:
        raise CfirError(f"{ids_path}: not a UTF-8 text file of image ids") from None
    if emb.ndim != 2 or len(ids) != emb.shape[0]:
        raise CfirError(f"{path}: shape {emb.shape} does not match the {len(ids)} ids of {ids_path}; "
                        "expected [num_ids, D]")
    step = 65536
    chunks = ((ids[i : i + step], np.asarray(emb[i : i + step])) for i in range(0, len(ids), step))
    return [path, Path(ids_path)], chunks


def _parquet_source(path: Path) -> tuple[list[Path], Iterator[tuple[list[str], np.ndarray]]]:
    # why: pyarrow loads only when embeddings are imported from parquet
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


def open_source(corpus: Corpus, source: str | os.PathLike, ids_path: str | os.PathLike | None):
    """(files that fingerprint the source, an iterator of (ids, embeddings [n, D]) chunks) of a precomputed source:
    "corpus" (its own embeddings.npy), a .npy with an ids file, or parquet."""
    if str(source) == "corpus":
        emb = corpus.embeddings()
        if emb is None:
            raise CfirError(f"{corpus.path}: the corpus has no precomputed embeddings; pass a model or a .npy/parquet")
        ids, step = corpus.image_ids, 65536
        return corpus.embedding_files, ((ids[i : i + step], np.asarray(emb[i : i + step]))
                                                  for i in range(0, len(ids), step))
    path = Path(source)
    if not path.exists():
        raise CfirError(f"{path}: precomputed embeddings not found; pass a .npy or .parquet file")
    if path.suffix == ".npy":
        return _npy_source(path, Path(ids_path) if ids_path is not None else None)
    if path.suffix == ".parquet" or path.is_dir():
        return _parquet_source(path)
    raise CfirError(f"{path}: unknown embeddings format; use a .npy (with ids file) or .parquet file")


def _chunk_rows(source, corpus: Corpus, ids: list[str], emb: np.ndarray, dim: int, row_of: dict[str, int],
                have: np.ndarray) -> np.ndarray:
    """The corpus rows [n] of one chunk, refused in one line when its dim differs, it holds non-finite values, ids
    the corpus lacks, or ids seen before."""
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
    return rows


def import_precomputed(
    out_dir: Path,
    corpus: Corpus,
    source: str | os.PathLike,
    ids_path: str | os.PathLike | None,
    dtype: str,
    allow_missing: bool,
) -> ImageCache:
    """Writes a cache from existing embeddings, matched to the corpus by image id (rows follow corpus order)."""
    files, chunks = open_source(corpus, source, ids_path)
    fp = f"precomputed:{digest_files(files)}"
    expected = dict(fingerprint=fp, dtype=dtype, corpus_images=corpus.num_images,
                    corpus_ids_sha=digest_ids(corpus.image_ids), allow_missing=allow_missing)
    if is_current(out_dir, expected):
        return ImageCache.open(out_dir)

    start = time.time()
    n = corpus.num_images
    row_of = {image_id: r for r, image_id in enumerate(corpus.image_ids)}
    have = np.zeros(n, bool)
    dim, max_norm = None, 0.0
    with atomic_dir(out_dir) as tmp:
        full = None
        for ids, emb in chunks:
            if dim is None:
                dim = int(emb.shape[1])
                if dim == 0:
                    raise CfirError(f"{source}: embeddings have dimension 0")
                full = np.lib.format.open_memmap(tmp / "all_rows.npy", mode="w+", dtype=dtype, shape=(n, dim))
            rows = _chunk_rows(source, corpus, ids, emb, dim, row_of, have)
            full[rows] = emb.astype(dtype)
            max_norm = max(max_norm, float(np.linalg.norm(emb.astype(np.float32), axis=1).max(initial=0.0)))
            have[rows] = True
        if dim is None:
            raise CfirError(f"{source}: no embedding rows")
        removed = np.asarray([i in corpus.removed_image_ids for i in corpus.image_ids], bool)
        have &= ~removed  # the images the corpus had removed (`index.py --remove`) are skipped and listed
        missing = np.flatnonzero(~have & ~removed)
        if len(missing) and not allow_missing:
            raise CfirError(f"{source}: {len(missing)} corpus images have no embedding (first: "
                            f"{', '.join(repr(corpus.image_ids[r]) for r in missing[:3])}); "
                            "add them or pass allow_missing=True to skip them")
        full.flush()
        del full
        kept = _keep_rows(tmp, have, dtype, dim)
        ids_kept = [corpus.image_ids[r] for r in kept]
        skipped = [SkippedImage(corpus.image_ids[r], "removed" if removed[r] else "no precomputed embedding")
                   for r in np.flatnonzero(~have)]
        write_lists(tmp, ids_kept, skipped)
        write_manifest(tmp, KIND, FORMAT_VERSION, **expected, dim=dim, compute_dtype=None, image_size=None,
                       shard_size=None, num_encoded=len(ids_kept), num_skipped=len(skipped),
                       source=os.fspath(source), build_seconds=round(time.time() - start, 3),
                       max_row_norm=round(max_norm, 6))
    return ImageCache.open(out_dir)


def _keep_rows(tmp: Path, have: np.ndarray, dtype: str, dim: int) -> np.ndarray:
    """embeddings.npy in `tmp` from all_rows.npy: the rows that have an embedding (all of them: a rename); returns
    their corpus rows."""
    if have.all():
        os.replace(tmp / "all_rows.npy", tmp / "embeddings.npy")
        return np.arange(len(have))
    kept = np.flatnonzero(have)
    full = np.load(tmp / "all_rows.npy", mmap_mode="r")
    out = np.lib.format.open_memmap(tmp / "embeddings.npy", mode="w+", dtype=dtype, shape=(len(kept), dim))
    for i in range(0, len(kept), 65536):
        out[i : i + 65536] = full[kept[i : i + 65536]]
    out.flush()
    del out, full
    (tmp / "all_rows.npy").unlink()
    return kept
