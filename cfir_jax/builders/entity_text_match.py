"""The entity_text_match stage's build (beyond the paper): per entity of the entity index, the images whose own text
names it, in chunks owned round-robin by the processes, committed by process 0 into the store that
`cfir_jax.stores.entity_text_match` reads. Declared here (`cfir_jax.builders.descriptor`): its stage of index.py
(`entity_text_match_stage`), and under changes of the collection matched again after an add or --add-entities, and
re-keyed after a removal or a compaction."""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from cfir_jax.builders.chunks import shared_work_dir
from cfir_jax.builders.descriptor import REBUILD, REMAP, Build, Changes, Stage, StageRun, Step, declare
from cfir_jax.builders.image_cache_update import row_map
from cfir_jax.builders.image_text import FIELDS, image_text
from cfir_jax.builders.store_update import ChangeRun
from cfir_jax.core import hosts
from cfir_jax.core.errors import CfirError
from cfir_jax.core.progress import bar as progress_bar
from cfir_jax.core.progress import shown
from cfir_jax.stores.atomic_write import savez_atomic
from cfir_jax.stores.contract import StoreError, atomic_dir, manifest_digest, write_manifest
from cfir_jax.stores.entity_index import EntityIndex

if TYPE_CHECKING:
    from cfir_jax.data.corpus import Corpus
    from cfir_jax.stores.image_cache import ImageCache
from cfir_jax.stores.entity_text_match import FORMAT_VERSION, KIND, READER, EntityTextMatch

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


@dataclass(frozen=True)
class MatchSettings:
    """How entities are matched against the images' texts (index.entity_text_match's keys): the image text
    `fields`, at most `max_matches` images an entity, names of at most `max_words` words, `chunk_rows` images a chunk
    of the build."""

    fields: tuple[str, ...] = tuple(FIELDS)
    max_matches: int = 1000
    max_words: int = 8
    chunk_rows: int = 65536

    @classmethod
    def of(cls, section) -> MatchSettings:
        """The settings of the config section index.entity_text_match."""
        return cls(tuple(section.fields), section.max_matches, section.max_words, section.chunk_rows)


def build_entity_text_match(
    out_dir: str | os.PathLike,
    corpus: Corpus,
    cache: ImageCache,
    entity_index: EntityIndex,
    settings: MatchSettings = MatchSettings(),
    *,
    progress: bool | None = None,
) -> EntityTextMatch:
    """Matches every entity of `entity_index` against the text of every image of `cache` (module docstring);
    reuses a current store."""
    fields, max_matches, max_words, chunk_rows = (settings.fields, settings.max_matches, settings.max_words,
                                                  settings.chunk_rows)
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


# ------------------------------------------------------------------------------- under changes of the collection
_BOOKKEEPING = ("kind", "format_version", "created")


def entity_text_match_again(change: ChangeRun, out: Path) -> dict:
    """W/entity_text_match matched again over the new collection (a pass over the image texts, no model): new images
    may name old entities, and new entities (an add, --add-entities) may be named by old images."""
    corpus, cache, index = change.new("corpus"), change.new("image_cache"), change.new("entity_index")
    m = change.config.index.entity_text_match
    build = out.parent / f"{out.name}.match"  # the builder commits into a directory of its own
    store = build_entity_text_match(build, corpus, cache, index, MatchSettings.of(m))
    for child in build.iterdir():
        os.replace(child, out / child.name)
    build.rmdir()
    return {"pairs": int(store.manifest["num_pairs"])}


def _kept_entities(old: EntityIndex, new: EntityIndex) -> np.ndarray:
    """Which rows of the old entity index the new one kept (a removal only drops rows, never reorders them)."""
    kept = set(new.vocab)
    return np.array([t in kept for t in old.vocab], bool)


def entity_text_match_rekeyed(change: ChangeRun, out: Path) -> dict:
    """W/entity_text_match following a rewritten entity index: the entity rows a removal kept, and the image rows a
    compaction moved (the image cache's row map: the new row, or -1), recorded against the new builds."""
    cache, index = change.new("image_cache"), change.new("entity_index")
    old = EntityTextMatch.open(change.layout.entity_text_match)
    keep_entities = _kept_entities(change.old("entity_index"), index) if change.op == "remove" else None
    rows_to = row_map(change) if change.op == "compact" else None
    entities = np.flatnonzero(keep_entities) if keep_entities is not None else np.arange(len(old))
    lists = old.rows_of(entities)
    if rows_to is not None:
        lists = [rows_to[r] for r in lists]
        lists = [r[r >= 0].astype(np.int32) for r in lists]
    offsets = np.zeros(len(lists) + 1, np.int64)
    np.cumsum([len(r) for r in lists], out=offsets[1:])
    rows = np.concatenate(lists).astype(np.int32) if lists else np.zeros(0, np.int32)
    np.save(out / "offsets.npy", offsets)
    np.save(out / "rows.npy", rows)
    fields = {**{k: v for k, v in old.manifest.items() if k not in _BOOKKEEPING},
              "entity_index": manifest_digest(index.manifest),
              "cache_fingerprint": cache.content_fingerprint, "num_entities": len(lists), "num_pairs": int(len(rows)),
              "entities_matched": int((np.diff(offsets) > 0).sum())}
    write_manifest(out, KIND, FORMAT_VERSION, **fields)
    return {"pairs": int(len(rows))}


def entity_text_match_wanted(run: StageRun) -> bool:
    """Whether index.py builds W/entity_text_match: asked for, or needed by retrieval.entity_text_match."""
    return bool(run.config.index.entity_text_match.enabled) or bool(run.config.retrieval.entity_text_match)


def entity_text_match_stage(run: StageRun) -> EntityTextMatch | None:
    """Stage entity_text_match: None (skipped) when the corpus' images carry no text, else the opened store."""
    corpus, layout = run.opened["corpus"], run.layout
    if not corpus.manifest.get("images_with_text"):
        return None
    m = run.config.index.entity_text_match
    return build_entity_text_match(
        layout.entity_text_match, corpus, run.opened["image_cache"], EntityIndex.open(layout.entity_index),
        MatchSettings.of(m), progress=shown())


def _stage_summary(t: EntityTextMatch | None) -> str:
    if t is None:
        return "skipped: the corpus' images have no text"
    m = t.manifest
    return (f"{m['num_pairs']:,} (entity, image) pairs, {m['entities_matched']:,} entities matched, "
            f"{m['too_common']:,} too common")


declare(Stage(
    "entity_text_match", reader=READER,
    build=Build(entity_text_match_stage, _stage_summary, wanted=entity_text_match_wanted),
    changes=Changes(add=Step(REBUILD, entity_text_match_again), remove=Step(REMAP, entity_text_match_rekeyed),
                    compact=Step(REMAP, entity_text_match_rekeyed),
                    add_entities=Step(REBUILD, entity_text_match_again))))
