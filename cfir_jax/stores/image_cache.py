"""The image embedding cache: every corpus image encoded once by the frozen vision tower (stage 1 of indexing).

CFIR never trains the vision side, so each image is encoded exactly once and every later stage (the entity index,
the SR scorer, training's in-batch negatives) reads this cache instead of the pixels.

Layout of a cache directory (kind "image_cache"):
  embeddings.npy  [N, D] float16 (or float32), L2-normalised rows, memory-mappable with np.load(mmap_mode="r")
  ids.txt         N image ids, line i = row i (corpus order with the skipped images left out)
  skipped.tsv     `image_id<TAB>reason` (with a header line) for every image that could not be encoded, or that
                  the corpus had removed (reason "removed")
  removed.txt     optional: ids of cached images removed by `index.py --remove` (one a line); their rows stay until
                  `index.py --compact` rewrites the cache without them (`ImageCache.removed` masks them)
  manifest.json   format version, vision fingerprint, dim, dtype, counts, shard size, image size, build time;
                  `num_removed` and `removed_sha` when removed.txt exists (left out of `content_fingerprint`: rows do
                  not move on a removal, so the stores derived from the cache stay valid)

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

import dataclasses
import hashlib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from cfir_jax.core.errors import CfirError, StoreError
from cfir_jax.stores.contract import Store, manifest_digest, read_manifest

KIND = "image_cache"
FORMAT_VERSION = 1
STORAGE_DTYPES = ("float16", "float32")
REMOVED = "removed.txt"
# Manifest fields of the removed mask: not part of the cache's content (`ImageCache.content_fingerprint`).
REMOVAL_FIELDS = ("num_removed", "removed_sha")
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SkippedImage:
    """An image left out of the cache and why (empty bytes, undecodable data, no precomputed embedding)."""

    image_id: str
    reason: str


def digest_ids(ids: Sequence[str]) -> str:
    h = hashlib.sha256()
    for i in ids:
        h.update(i.encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


def digest_files(paths: Sequence[Path]) -> str:
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()[:16]


def check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise CfirError(f"{name}={value!r} is not supported; use one of {', '.join(choices)}")


def is_current(out_dir: Path, expected: dict) -> bool:
    """Whether out_dir already holds a complete cache built with the `expected` manifest fields."""
    try:
        manifest = read_manifest(out_dir, KIND, FORMAT_VERSION)
    except StoreError:
        return False
    return all(manifest.get(k) == v for k, v in expected.items()) and (out_dir / "embeddings.npy").is_file()


# ---------------------------------------------------------------------------------------------------- encoding


def write_lists(directory: Path, ids: Sequence[str], skipped: Sequence[SkippedImage]) -> None:
    (directory / "ids.txt").write_text("".join(f"{i}\n" for i in ids), encoding="utf-8")
    # A reason is free text from a decoder; tabs and newlines would break the TSV.
    lines = [f"{s.image_id}\t{' '.join(s.reason.split())}\n" for s in skipped]
    (directory / "skipped.tsv").write_text("image_id\treason\n" + "".join(lines), encoding="utf-8")


# ---------------------------------------------------------------------------------------------------- reading


class ImageCache(Store):
    """A complete image cache opened for reading: `embeddings` is one memory-mapped [N, D] array, row i = ids[i]."""

    KIND, VERSION = KIND, FORMAT_VERSION

    def __init__(self, path: Path, manifest: dict, ids: list[str], embeddings: np.ndarray):
        self.path = path
        self.manifest = manifest
        self.ids = ids
        self.embeddings = embeddings
        self._row_of: dict[str, int] | None = None
        self._removed: np.ndarray | None = None

    @classmethod
    def check(cls, manifest: dict, path: Path, expect_fingerprint: str | None = None,
              expect_dim: int | None = None) -> None:
        """Refuses a cache built by another model or of another dim."""
        super().check(manifest, path, fingerprint=expect_fingerprint,
                      dim=None if expect_dim is None else int(expect_dim))

    @classmethod
    def load(cls, path: Path, manifest: dict) -> ImageCache:
        emb_path, ids_path = path / "embeddings.npy", path / "ids.txt"
        if not emb_path.is_file() or not ids_path.is_file():
            raise StoreError(f"{path}: incomplete image cache (no embeddings.npy or ids.txt); rebuild it")
        try:
            embeddings = np.load(emb_path, mmap_mode="r")
        except (ValueError, OSError) as e:
            raise StoreError(f"{emb_path}: unreadable ({e.__class__.__name__}); rebuild the image cache") from None
        ids = ids_path.read_text(encoding="utf-8").split("\n")[:-1]
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
        return f"cache-{manifest_digest({k: v for k, v in self.manifest.items() if k not in REMOVAL_FIELDS})}"

    @property
    def removed_ids(self) -> list[str]:
        """Ids of the cached images removed since the build (removed.txt), in row order; [] when none."""
        path = self.path / REMOVED
        if not self.manifest.get("num_removed") or not path.is_file():
            return []
        return path.read_text(encoding="utf-8").split("\n")[:-1]

    @property
    def removed(self) -> np.ndarray:
        """bool [num_images]: the rows removed by `index.py --remove` (all False when none)."""
        if self._removed is None:
            mask = np.zeros(self.num_images, bool)
            ids = self.removed_ids
            if ids:
                mask[[self.index_of(i) for i in ids]] = True
            if int(mask.sum()) != int(self.manifest.get("num_removed") or 0):
                raise StoreError(f"{self.path / REMOVED}: {int(mask.sum())} removed rows but the manifest says "
                                 f"{self.manifest.get('num_removed')}; rebuild the image cache")
            self._removed = mask
        return self._removed

    @property
    def num_live(self) -> int:
        """Rows not removed."""
        return self.num_images - int(self.manifest.get("num_removed") or 0)

    def row(self, image_id: str) -> int | None:
        """Row of `image_id`, or None when it is not cached (unknown, or skipped at build time)."""
        if self._row_of is None:
            self._row_of = {i: r for r, i in enumerate(self.ids)}
        return self._row_of.get(image_id)

    def index_of(self, image_id: str) -> int:
        """Row of `image_id`; CfirError naming this cache's path if it is not cached (unknown, or skipped at build
        time). What a service answers to anyone uses `row`, and never names the path."""
        row = self.row(image_id)
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
        lines = (self.path / "skipped.tsv").read_text(encoding="utf-8").splitlines()[1:]
        return [SkippedImage(*line.split("\t", 1)) for line in lines]
