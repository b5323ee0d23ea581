"""Stores that cannot lie: checksums recorded at build time, `index.py --verify`, and the cheap checks of serving.

Three layers, from the most thorough (and slowest) to the cheapest:

- `write_checksums`: every store directory, when `contract.atomic_dir` commits it, records `checksums.json`: the
  sha256 of every file, per block of `BLOCK_BYTES` (64 MiB) so a damaged large array is named to the block and its
  rows. `verify_store` / `verify_workdir` (`index.py --verify`) re-read every byte and name each damaged, missing
  or unexpected file. Cost: reading the store once (sha256 at about 1 GB/s on one core here).
- Open-time checks, in each store's `open` (array shapes and dtypes against its manifest, offsets monotone,
  candidate ids in range when cheap): no more than the headers and the small arrays are read.
- Serving checks (`check_rows`, `check_scores`): the candidate union of a query lies in [0, N) and the scores that
  come back are finite and no larger than unit vectors allow. A damaged row scores NaN or far above 1 (random bytes
  read as float16 give values up to 65,504); retrieval refuses it in one line naming the stores and `--verify`
  instead of ranking it first.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np

from cfir_jax.core.errors import StoreError
from cfir_jax.stores.atomic_write import write_json_atomic

CHECKSUMS = "checksums.json"
BLOCK_BYTES = 64 << 20
FORMAT = 1
# A dot product of a unit query with a stored row is at most the row's norm; float16 storage and float32
# accumulation leave it within ~1e-3 of that. A score beyond this factor of the bound is impossible.
SCORE_SLACK = 1.05


MANIFEST = "manifest.json"  # every store directory's record of what it holds (cfir_jax.stores.contract)


class CorruptStore(StoreError):
    """A store's bytes are not those it was built with (or serve an impossible answer)."""


class Throttle:
    """Paces a reader to at most `bytes_per_s` (None or 0: as fast as the disk allows), so a background pass over
    the stores leaves the cores and the disk to queries; `stop` (a threading.Event) ends a pass early."""

    def __init__(self, bytes_per_s: float | None = None, stop=None):
        self.rate = float(bytes_per_s) if bytes_per_s else None
        self.stop = stop
        self._t0, self._done = None, 0

    def __call__(self, n: int) -> None:
        if self.stop is not None and self.stop.is_set():
            raise InterruptedError("verification stopped")
        if self.rate is None:
            return
        now = time.monotonic()
        if self._t0 is None:
            self._t0 = now
        self._done += n
        ahead = self._done / self.rate - (now - self._t0)
        if ahead > 0:
            time.sleep(ahead)


_PIECE = 1 << 20  # bytes read at a time: a throttled pass sleeps between pieces, not whole 64 MiB blocks


def _file_blocks(path: Path, block: int, throttle: Throttle | None = None) -> list[str]:
    digests = []
    with open(path, "rb") as f:
        while True:
            h, size = hashlib.sha256(), 0
            while size < block:
                piece = f.read(min(_PIECE, block - size))
                if not piece:
                    break
                h.update(piece)
                size += len(piece)
                if throttle is not None:
                    throttle(len(piece))
            if not size and digests:
                break
            digests.append(h.hexdigest())
            if size < block:
                break
    return digests


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != CHECKSUMS)


def write_checksums(directory: str | os.PathLike, linked_from: str | os.PathLike | None = None) -> dict:
    """Records the size and per-block sha256 of every file under `directory` in `directory/checksums.json`.

    linked_from: the store a new version was made from by hard links (a change of the collection): a file that is
    the very same file there (same inode) keeps the checksum recorded there instead of being read again, so staging
    a grown corpus reads its new rows, not every image it already had."""
    directory = Path(directory)
    known = _linked_records(directory, Path(linked_from)) if linked_from is not None else {}
    files = {}
    for p in _files(directory):
        rel = p.relative_to(directory).as_posix()
        files[rel] = known.get(rel) or {"size": p.stat().st_size, "sha256": _file_blocks(p, BLOCK_BYTES)}
    record = {"format": FORMAT, "block_bytes": BLOCK_BYTES, "files": files}
    write_json_atomic(directory / CHECKSUMS, record)
    return record


def _linked_records(directory: Path, source: Path) -> dict[str, dict]:
    """{relative path: the checksum record of `source`} for the files of `directory` that are hard links of the
    same-named file of `source` (whose recorded checksums are of this block size)."""
    try:
        record = json.loads((source / CHECKSUMS).read_text())
    except (OSError, ValueError):
        return {}
    if record.get("format") != FORMAT or record.get("block_bytes") != BLOCK_BYTES:
        return {}
    out = {}
    for rel, entry in (record.get("files") or {}).items():
        try:
            mine, theirs = (directory / rel).stat(), (source / rel).stat()
        except OSError:
            continue
        if (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino) and mine.st_size == entry.get("size"):
            out[rel] = entry
    return out


def _rows_of_block(path: Path, block: int, block_bytes: int) -> str:
    """ " (rows A-B)" for a block of a .npy array, so a report says which rows are damaged; "" otherwise."""
    if path.suffix != ".npy":
        return ""
    try:
        array = np.load(path, mmap_mode="r")
    except (OSError, ValueError):
        return ""
    if array.ndim == 0 or not array.size:
        return ""
    row_bytes = array.itemsize * int(np.prod(array.shape[1:]))
    header = array.offset
    first = max(0, (block * block_bytes - header) // row_bytes)
    last = min(array.shape[0], -(-((block + 1) * block_bytes - header) // row_bytes)) - 1
    return f" (rows {first:,}-{last:,})"


def verify_store(directory: str | os.PathLike, throttle: Throttle | None = None) -> list[str]:
    """Re-reads every file of a store against its checksums: one line per damaged, missing or unexpected file
    (empty when the store is intact). A store without checksums (built before they were recorded) is one line.
    The one implementation of `index.py --verify` and of the service's background pass (paced by `throttle`)."""
    directory = Path(directory)
    path = directory / CHECKSUMS
    if not path.is_file():
        if not (directory / MANIFEST).is_file():
            return [f"{directory}: incomplete store (no {MANIFEST}); rebuild it with index.py"]
        return [f"{directory}: no {CHECKSUMS} (built before stores recorded checksums): cannot verify; rebuild it "
                "with index.py to protect it"]
    try:
        record = json.loads(path.read_text())
        files, block_bytes = record["files"], int(record["block_bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        return [f"{path}: damaged checksums; rebuild the store with index.py"]
    problems = []
    for name, want in sorted(files.items()):
        file = directory / name
        if not file.is_file():
            problems.append(f"{file}: missing")
            continue
        size = file.stat().st_size
        if size != want["size"]:
            problems.append(f"{file}: {size:,} bytes but {want['size']:,} were written")
            continue
        have = _file_blocks(file, block_bytes, throttle)
        bad = [i for i, (a, b) in enumerate(zip(have, want["sha256"])) if a != b]
        if bad:
            blocks = ", ".join(f"{i}{_rows_of_block(file, i, block_bytes)}" for i in bad[:4])
            more = f" and {len(bad) - 4} more" if len(bad) > 4 else ""
            size = f"{block_bytes >> 20} MiB" if block_bytes >= 1 << 20 else f"{block_bytes:,} bytes"
            problems.append(f"{file}: damaged (checksum differs in block {blocks}{more} of {len(have)}, "
                            f"{size} each)")
    for file in _files(directory):
        if file.relative_to(directory).as_posix() not in files:
            problems.append(f"{file}: not part of the store as built")
    return problems


def verify_workdir(root: str | os.PathLike, stores: tuple[str, ...], throttle: Throttle | None = None
                   ) -> tuple[list[str], list[str]]:
    """(the stores checked intact, one line per problem) over the `stores` of a workdir that exist (its
    `Layout.store_dirs()`: the training runs, which hold no manifest, are no stores)."""
    root = Path(root)
    intact, problems = [], []
    for name in stores:
        directory = root / name
        if not directory.is_dir():
            continue
        found = verify_store(directory, throttle)
        problems += found
        if not found:
            intact.append(name)
    return intact, problems


def check_rows(rows: np.ndarray, num_rows: int, store: str | os.PathLike) -> None:
    """Refuses candidate ids outside [0, num_rows) (a damaged candidate list); `rows` sorted ascending, so the
    check reads two numbers."""
    if len(rows) and (rows[0] < 0 or rows[-1] >= num_rows):
        bad = rows[0] if rows[0] < 0 else rows[-1]
        raise CorruptStore(f"{store}: candidate id {int(bad)} is outside the {num_rows:,} cached images: the store "
                           "is damaged; run index.py --verify --workdir W to name the file, then rebuild it")


def check_scores(scores: np.ndarray, bound: float, stores: str) -> None:
    """Refuses scores no intact store can produce: NaN, infinite, or above `bound` (the largest dot product of the
    query with a stored row) by more than float16 rounding. `stores` names where the rows came from."""
    scores = np.asarray(scores)
    if not scores.size:
        return
    top = float(np.max(np.abs(scores)))
    if top <= bound * SCORE_SLACK and top != np.inf:  # False for NaN too
        return
    what = "NaN" if np.isnan(scores).any() else f"{top:.4g} (at most {bound:.3g} is possible)"
    raise CorruptStore(f"{stores}: an impossible score {what}: the store is damaged; run index.py --verify "
                       "--workdir W to name the file, then rebuild it")


# An L2-normalised float32 embedding has norm 1 to ~1e-6; a damaged model gives NaN, infinities or norms far off.
EMBEDDING_NORM_TOLERANCE = 1e-2


def check_embeddings(embeddings: np.ndarray, model_dir: str | os.PathLike, what: str = "query") -> None:
    """Refuses embeddings a model that promises L2-normalised output cannot give: non-finite, or of a norm other
    than 1. Such embeddings mean the model is damaged (not a store they are later scored against): the message
    names the model directory, so that a NaN score is never blamed on the image cache."""
    embeddings = np.asarray(embeddings, np.float32)
    if not embeddings.size:
        return
    finite = np.isfinite(embeddings).all()
    norms = np.linalg.norm(embeddings, axis=-1) if finite else None
    if finite and np.all(np.abs(norms - 1.0) <= EMBEDDING_NORM_TOLERANCE):
        return
    bad = "not finite" if not finite else \
        f"of norm {float(norms[np.argmax(np.abs(norms - 1.0))]):.4g}, not 1"
    article = "an" if what[:1] in "aeiou" else "a"
    raise CorruptStore(f"{model_dir}: {article} {what} embedding is {bad}: the model's parameters are damaged; run "
                       "index.py --verify --workdir W to name the file, then restore or retrain the model")


def row_norm_bound(manifest: dict) -> float:
    """The largest L2 norm of an image cache's rows: recorded for imported embeddings, 1 for the encoder's own
    (L2-normalised); unknown (inf: only NaN and infinity are then refused) for embeddings imported before the
    norm was recorded."""
    if "max_row_norm" in manifest:
        return float(manifest["max_row_norm"])
    return 1.0 if manifest.get("source", "model") == "model" else float("inf")


# Arrays up to this many values are range-checked in full when opened (~10 ms per 16M int32 here); larger ones
# only at serving time, where each query's union is checked (`check_rows`), and by --verify.
OPEN_SCAN_LIMIT = 1 << 24


def check_csr(offsets: np.ndarray, values: np.ndarray, num_values: int | None, where: str | os.PathLike) -> None:
    """The cheap open-time checks of a ragged CSR store: offsets start at 0, never decrease and end at the values'
    length; the values lie in [0, num_values) when there are few enough to scan (`OPEN_SCAN_LIMIT`)."""
    offsets = np.asarray(offsets)
    if len(offsets) == 0 or offsets[0] != 0 or offsets[-1] != len(values) or (np.diff(offsets) < 0).any():
        raise CorruptStore(f"{where}: offsets are not monotone from 0 to {len(values):,}: the store is damaged; run "
                           "index.py --verify --workdir W to name the file, then rebuild it")
    if num_values is not None and 0 < len(values) <= OPEN_SCAN_LIMIT:
        low, high = int(np.min(values)), int(np.max(values))
        if low < 0 or high >= num_values:
            raise CorruptStore(f"{where}: id {low if low < 0 else high} is outside [0, {num_values:,}): the store "
                               "is damaged; run index.py --verify --workdir W to name the file, then rebuild it")
