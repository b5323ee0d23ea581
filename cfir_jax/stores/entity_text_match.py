"""Beyond the paper: entities matched against what images say about themselves (off by default).

CFIR's ER finds an entity's images only through the embedding space: the entity text's top-K images by dot
product. An image whose own text (AToMiC's reference, alt-text and attribution captions) names the entity is direct
evidence that the embedding may miss, most of all for rare names the frozen encoder has never seen. This store lists,
for every entity of the entity index, the cache rows whose image text contains the entity's name as whole words
(case-folded, so "The Hague" matches "the hague, 1890" but "Hague" does not match "Hagueville"); retrieval adds them
to that entity's candidate list (`retrieval.entity_text_match`). A name mentioned by more than `max_matches` images
says little about any one of them ("London" in a million attributions): it is left out (counted in the manifest).

Layout of the store (kind "entity_text_match", format 1), aligned with the entity index's rows:
  offsets.npy   int64 [E + 1]   entity i's images are rows[offsets[i]:offsets[i + 1]], ascending
  rows.npy      int32 [M]       image cache rows
  manifest.json the entity index and image cache builds it follows, the fields, max_matches, counts

Matching is one pass over the image texts: every run of up to `max_words` consecutive words is looked up in a hash
map of the entity names (names are short; longer ones never match), so the cost is linear in the text, not in the
number of entities. Image rows are cut into chunks; under jax.distributed process p matches the chunks c with
c % P == p (`cfir_jax.core.hosts`) into `.<name>.building/chunk-*.npz`, a finished chunk is never redone (a killed run
resumes), and process 0 commits the store once every chunk exists.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from cfir_jax.core import hosts
from cfir_jax.core.errors import CfirError
from cfir_jax.core.progress import bar as progress_bar
from cfir_jax.stores.atomic_write import savez_atomic
from cfir_jax.stores.contract import (
    StoreError,
    atomic_dir,
    manifest_digest,
    read_manifest,
    shared_work_dir,
    write_manifest,
)
from cfir_jax.stores.image_text import FIELDS, image_text
from cfir_jax.stores.integrity import check_csr

if TYPE_CHECKING:
    from cfir_jax.data.corpus import Corpus
    from cfir_jax.stores.entity_index import EntityIndex
    from cfir_jax.stores.image_cache import ImageCache

KIND = "entity_text_match"
FORMAT_VERSION = 1
# A word: letters/digits/underscore, with inner apostrophes or hyphens kept ("McDonald's", "Saint-Denis").
_WORD = re.compile(r"\w+(?:['\u2019\-]\w+)*")


def words(text: str) -> tuple[str, ...]:
    """The case-folded words of `text` (curly apostrophes read as straight ones)."""
    return tuple(_WORD.findall(text.casefold().replace("\u2019", "'")))


def match_entities(names: Sequence[str], texts: Sequence[str], max_words: int = 8) -> list[list[int]]:
    """For each of `texts`, the indices of `names` it mentions as whole words, ascending (names longer than
    `max_words` words, or with no word at all, never match)."""
    table: dict[tuple[str, ...], list[int]] = {}
    for i, name in enumerate(names):
        key = words(name)
        if 0 < len(key) <= max_words:
            table.setdefault(key, []).append(i)
    first = {key[0] for key in table}
    longest = max((len(key) for key in table), default=0)
    found: list[list[int]] = []
    for text in texts:
        w = words(text)
        hits: set[int] = set()
        for start, word in enumerate(w):
            if word not in first:
                continue
            for n in range(1, min(longest, len(w) - start) + 1):
                hits.update(table.get(w[start : start + n], ()))
        found.append(sorted(hits))
    return found


def build_entity_text_match(
    out_dir: str | os.PathLike,
    corpus: Corpus,
    cache: ImageCache,
    entity_index: EntityIndex,
    *,
    fields: Sequence[str] = FIELDS,
    max_matches: int = 1000,
    max_words: int = 8,
    chunk_rows: int = 65536,
    progress: bool | None = None,
) -> EntityTextMatch:
    """Matches every entity of `entity_index` against the text of every image of `cache` (module docstring);
    reuses a current store."""
    out_dir = Path(out_dir)
    fields = list(fields)
    unknown = [f for f in fields if f not in FIELDS]
    if not fields or unknown:
        raise CfirError(f"index.entity_text_match.fields={fields!r}: choose among {', '.join(FIELDS)}")
    if max_matches < 1 or max_words < 1:
        raise CfirError(f"index.entity_text_match: max_matches={max_matches} and max_words={max_words} must be >= 1")
    key = dict(entity_index=manifest_digest(entity_index.manifest), cache_fingerprint=cache.content_fingerprint,
               fields=fields, max_matches=int(max_matches), max_words=int(max_words))
    try:
        return EntityTextMatch.open(out_dir, **key)
    except StoreError:
        pass
    start = time.time()
    work = shared_work_dir(out_dir, key)
    row_of = {image_id: r for r, image_id in enumerate(corpus.image_ids)}
    n = cache.num_images
    chunks = range(-(-n // chunk_rows))
    mine = hosts.owned_row_chunks(n, chunk_rows)
    with progress_bar(total=sum(hi - lo for _, lo, hi in mine), desc="entity text match", unit="img",
                      show=progress) as bar:
        for c, lo, hi in mine:
            path = work / f"chunk-{c:05d}.npz"
            if not path.is_file():  # finished by this process or another, in this run or before
                texts = [image_text(corpus.image(row_of[i]), fields) for i in cache.ids[lo:hi]]
                found = match_entities(entity_index.vocab, texts, max_words)
                entity = np.fromiter((e for hits in found for e in hits), np.int64)
                rows = np.repeat(np.arange(lo, hi, dtype=np.int32), [len(hits) for hits in found])
                savez_atomic(path, entity=entity, rows=rows)  # its presence marks the chunk complete
            bar.update(hi - lo)
    hosts.barrier("entity_text_match_chunks")
    if hosts.is_main():
        _commit(out_dir, work, chunks, key, len(entity_index), start)
    hosts.barrier("entity_text_match_committed")
    return EntityTextMatch.open(out_dir)


def _commit(out_dir: Path, work: Path, chunks: range, key: dict, num_entities: int, start: float) -> None:
    """Process 0: the store from every chunk's (entity, row) pairs, too common names left out; removes the work."""
    parts = []
    for c in chunks:
        path = work / f"chunk-{c:05d}.npz"
        if not path.is_file():
            raise StoreError(f"{path}: missing after every process finished; rerun index.py")
        with np.load(path) as z:
            parts.append((z["entity"], z["rows"]))
    entity = np.concatenate([e for e, _ in parts]) if parts else np.zeros(0, np.int64)
    rows = np.concatenate([r for _, r in parts]) if parts else np.zeros(0, np.int32)
    order = np.lexsort((rows, entity))  # by entity, then ascending row
    entity, rows = entity[order], rows[order]
    counts = np.bincount(entity, minlength=num_entities)
    too_common = counts > key["max_matches"]
    keep = ~too_common[entity]
    entity, rows = entity[keep], rows[keep]
    offsets = np.zeros(num_entities + 1, np.int64)
    np.cumsum(np.bincount(entity, minlength=num_entities), out=offsets[1:])
    with atomic_dir(out_dir) as tmp:
        np.save(tmp / "offsets.npy", offsets)
        np.save(tmp / "rows.npy", rows)
        write_manifest(tmp, KIND, FORMAT_VERSION, **key, num_entities=num_entities, num_pairs=int(len(rows)),
                       entities_matched=int((np.diff(offsets) > 0).sum()), too_common=int(too_common.sum()),
                       build_seconds=round(time.time() - start, 3))
    shutil.rmtree(work, ignore_errors=True)


class EntityTextMatch:
    """The complete store opened for reading: `rows_of(entity_rows)` -> the matched image rows of each entity."""

    def __init__(self, path: Path, manifest: dict, offsets: np.ndarray, rows: np.ndarray):
        self.path, self.manifest, self.offsets, self.rows = path, manifest, offsets, rows

    @classmethod
    def open(cls, path: str | os.PathLike, **expect) -> EntityTextMatch:
        """Opens the store; a one-line StoreError when missing, incomplete, or built from other sources than
        `expect` (manifest fields: the entity index and cache builds, fields, max_matches)."""
        path = Path(path)
        manifest = read_manifest(path, KIND, FORMAT_VERSION)
        for name, want in expect.items():
            if manifest.get(name) != want:
                raise StoreError(f"{path}: stale, built for {name}={manifest.get(name)!r} but that is now {want!r}; "
                                 "rebuild it with index.py --stages entity_text_match")
        try:
            offsets = np.load(path / "offsets.npy")
            rows = np.load(path / "rows.npy", mmap_mode="r")
        except (OSError, ValueError) as e:
            raise StoreError(f"{path}: unreadable ({e.__class__.__name__}); rebuild it with index.py") from None
        if len(offsets) != manifest["num_entities"] + 1 or offsets[-1] != len(rows):
            raise StoreError(f"{path}: offsets and rows disagree with the manifest; rebuild it with index.py")
        check_csr(offsets, rows, None, path)
        return cls(path, manifest, offsets, rows)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def rows_of(self, entity_rows: Sequence[int] | np.ndarray) -> list[np.ndarray]:
        """int32 [m_i] ascending image rows per entity row (empty when nothing matched)."""
        return [np.asarray(self.rows[self.offsets[e] : self.offsets[e + 1]]) for e in entity_rows]
