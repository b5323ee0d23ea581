"""The image_text stage's build (beyond the paper): each cached image's own text embedded by the frozen text tower,
in chunks owned round-robin by the processes, merged by process 0 into the store that `cfir_jax.stores.image_text`
reads. Under changes of the collection (registered with the change loop) the added rows' texts are encoded and
appended, and a compaction keeps the rows the image cache keeps."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from cfir_jax.builders.chunks import shared_work_dir
from cfir_jax.builders.descriptor import EXTEND, REMAP, Build, Changes, Stage, StageRun, Step, declare
from cfir_jax.builders.image_cache_update import row_map
from cfir_jax.builders.index_encoder import check_cache_encoder, load_encoder
from cfir_jax.builders.store_update import ChangeRun
from cfir_jax.core import hosts
from cfir_jax.core.config import IMAGE_TEXT_FIELDS as FIELDS  # AToMiC's image text columns, the default fields embedded
from cfir_jax.core.errors import CfirError
from cfir_jax.core.progress import bar as progress_bar
from cfir_jax.core.progress import shown
from cfir_jax.model.tokenizer import resolve_tokenizer
from cfir_jax.stores.atomic_write import save_npy_atomic, write_json_atomic
from cfir_jax.stores.contract import StoreError, atomic_dir, write_manifest

if TYPE_CHECKING:
    from cfir_jax.data.corpus import Corpus, Image
    from cfir_jax.model.text_encoder import TextEncoder
    from cfir_jax.stores.image_cache import ImageCache
from cfir_jax.stores.image_text import FORMAT_VERSION, KIND, READER, ImageTextCache


def image_text(image: Image, fields: Sequence[str] = FIELDS) -> str:
    """The text an image says about itself: its non-empty strings of `fields`, de-duplicated, joined; '' if none."""
    parts: list[str] = []
    for field in fields:
        for text in image.texts.get(field, ()):
            text = " ".join(text.split())
            if text and text not in parts:
                parts.append(text)
    return " ".join(parts)


def _chunk(shard: int) -> str:
    return f"chunk-{shard:05d}"


def build_image_text(
    out_dir: str | os.PathLike,
    corpus: Corpus,
    cache: ImageCache,
    encoder: TextEncoder,
    fingerprint: str,
    *,
    fields: Sequence[str] = FIELDS,
    chunk_rows: int = 65536,
    progress: bool | None = None,
) -> ImageTextCache:
    """Embeds the text of every image of `cache` (row order kept) with `encoder`, the frozen text tower whose
    `fingerprint` the manifest records; reused when current, resumed when interrupted (module docstring)."""
    out_dir = Path(out_dir)
    fields = list(fields)
    unknown = [f for f in fields if f not in FIELDS]
    if not fields or unknown:
        raise CfirError(f"index.image_text.fields={fields!r}: choose among {', '.join(FIELDS)}")
    key = dict(fingerprint=fingerprint, cache_fingerprint=cache.content_fingerprint, fields=fields,
               max_text_len=int(encoder.max_len), dim=int(encoder.dim), num_rows=cache.num_images)
    try:
        return ImageTextCache.open(out_dir, **{f"expect_{k}": v for k, v in key.items()})
    except StoreError:
        pass
    start = time.time()
    work = shared_work_dir(out_dir, key)
    row_of = {image_id: r for r, image_id in enumerate(corpus.image_ids)}
    n, dim = cache.num_images, int(encoder.dim)
    chunks = range(-(-n // chunk_rows))
    mine = hosts.owned_row_chunks(n, chunk_rows)
    bar = progress_bar(total=sum(hi - lo for _, lo, hi in mine), desc="image text", unit="img", show=progress)
    for c, lo, hi in mine:
        if (work / f"{_chunk(c)}.json").is_file():  # finished by this process or another, in this run or before
            bar.update(hi - lo)
            continue
        texts = [image_text(corpus.image(row_of[i]), fields) for i in cache.ids[lo:hi]]
        has = np.array([bool(t) for t in texts], bool)
        emb = np.zeros((hi - lo, dim), np.float16)
        if has.any():
            emb[has] = encoder.encode([t for t in texts if t]).astype(np.float16)
        save_npy_atomic(work / f"{_chunk(c)}.npy", emb)
        # Written last: its presence marks the chunk complete.
        write_json_atomic(work / f"{_chunk(c)}.json", {"rows": [lo, hi], "has_text": has.tolist()})
        bar.update(hi - lo)
    bar.close()
    hosts.barrier("image_text_chunks")
    if hosts.is_main():
        _merge(out_dir, work, chunks, key, n, dim, cache, start)
    hosts.barrier("image_text_committed")
    return ImageTextCache.open(out_dir)


def _merge(out_dir: Path, work: Path, chunks: range, key: dict, n: int, dim: int, cache: ImageCache, start: float
           ) -> None:
    """Writes the store from every finished chunk (process 0), then removes the work directory."""
    with atomic_dir(out_dir) as tmp:
        out = np.lib.format.open_memmap(tmp / "embeddings.npy", mode="w+", dtype=np.float16, shape=(n, dim))
        has_text = np.zeros(n, bool)
        for c in chunks:
            if not (work / f"{_chunk(c)}.json").is_file():
                raise StoreError(f"{work}: {_chunk(c)} is missing after every process finished; run index.py again")
            meta = json.loads((work / f"{_chunk(c)}.json").read_text())
            lo, hi = meta["rows"]
            out[lo:hi] = np.load(work / f"{_chunk(c)}.npy")
            has_text[lo:hi] = meta["has_text"]
        out.flush()
        del out
        np.save(tmp / "has_text.npy", has_text)
        write_manifest(tmp, KIND, FORMAT_VERSION, **key, dtype="float16", num_with_text=int(has_text.sum()),
                       ids_sha=hashlib.sha256("\n".join(cache.ids).encode()).hexdigest()[:16],
                       build_seconds=round(time.time() - start, 3))
    shutil.rmtree(work, ignore_errors=True)


# ------------------------------------------------------------------------------- under changes of the collection
_BOOKKEEPING = ("kind", "format_version", "created")


def _ids_sha(ids: list[str]) -> str:
    return hashlib.sha256("\n".join(ids).encode()).hexdigest()[:16]


def _write_image_text(out: Path, manifest: dict, embeddings: np.ndarray, has_text: np.ndarray, cache: ImageCache
                      ) -> dict:
    np.save(out / "embeddings.npy", embeddings)
    np.save(out / "has_text.npy", has_text)
    fields = {**{k: v for k, v in manifest.items() if k not in _BOOKKEEPING},
              "cache_fingerprint": cache.content_fingerprint, "num_rows": cache.num_images,
              "num_with_text": int(has_text.sum()), "ids_sha": _ids_sha(cache.ids)}
    write_manifest(out, KIND, FORMAT_VERSION, **fields)
    return {"rows": cache.num_images, "with_text": int(has_text.sum())}


def image_text_after_add(change: ChangeRun, out: Path) -> dict:
    """W/image_text with the new cache rows' texts encoded by the index encoder and appended (the old rows are kept
    as they are: the same text tower embedded them)."""
    # why: flax loads when a model is opened, not on import
    from cfir_jax.model.text_encoder import TextEncoder

    config, layout, corpus = change.config, change.layout, change.new("corpus")
    old_cache, cache = change.old("image_cache"), change.new("image_cache")
    old = change.old("image_text")
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


def image_text_after_compaction(change: ChangeRun, out: Path) -> dict:
    """W/image_text without the rows the compaction dropped (the image cache's row map: the new row, or -1)."""
    old = change.old("image_text")
    keep = np.flatnonzero(row_map(change) >= 0)
    return _write_image_text(out, old.manifest, np.asarray(old.embeddings[keep]), old.has_text[keep],
                             change.new("image_cache"))


def image_text_wanted(run: StageRun) -> bool:
    """Whether index.py builds W/image_text: asked for (index.image_text.enabled) or needed (fusion.w_txt != 0)."""
    return bool(run.config.index.image_text.enabled) or float(run.config.retrieval.fusion.w_txt) != 0.0


def image_text_stage(run: StageRun) -> ImageTextCache | None:
    """Stage image_text: None (skipped) when the corpus' images carry no text, else the opened store."""
    # why: flax loads when a model is opened, not on import
    from cfir_jax.model import checkpoint
    from cfir_jax.model.text_encoder import TextEncoder

    config, layout, corpus, cache = run.config, run.layout, run.opened["corpus"], run.opened["image_cache"]
    if not corpus.manifest.get("images_with_text"):
        return None
    it = config.index.image_text
    model = load_encoder(config, layout)
    check_cache_encoder(config, layout, cache)
    encoder = TextEncoder(model, resolve_tokenizer(config, corpus), it.max_text_len, it.encode_batch)
    return build_image_text(layout.image_text, corpus, cache, encoder, checkpoint.fingerprint(model, "text"),
                            fields=tuple(it.fields), chunk_rows=it.chunk_rows, progress=shown())


declare(Stage(
    "image_text", reader=READER,
    build=Build(image_text_stage, lambda t: "skipped: the corpus' images have no text" if t is None else
                f"{t.num_with_text:,} of {len(t.has_text):,} images with text", wanted=image_text_wanted),
    changes=Changes(add=Step(EXTEND, image_text_after_add), compact=Step(REMAP, image_text_after_compaction))))
