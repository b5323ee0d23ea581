"""Keeping a built collection current: `index.py --add PATH`, `--remove IDS.txt`, `--compact` and `--add-entities FILE`.

Each is one *change* of the workdir (`cfir_jax.stores.versions`), run by one loop (`change`) over the declared
stores (`cfir_jax.builders.descriptor`): every store the workdir holds says how it follows the change (extend, mask,
remap, rebuild, drop) and writes its new version under `W/.change/`; then all are committed together and
`W/index.json` records the new version and what changed. A reader (retrieve.py, the service on SIGHUP) sees the old
version or the new one, never a mix; a run killed at any point leaves the old version servable, and the same command
run again resumes from the stores already staged.

- add: the new rows become a part of the corpus; the new images are encoded (or imported) and appended to the image
  cache; the new documents' entities and summaries are appended; every indexed entity is scored against the new
  images and its top-K list merged, and the new documents' new entities are searched over the whole cache. With the
  exact backend the entity index is then bit-equal to a from-scratch build over the union.
- remove: the named images are masked (W/image_cache/removed.txt): the entity lists are refilled to K from the next
  best, and every method skips them at query time; removed documents take their entities out of the index when no
  remaining indexed document names them.
- compact: the image cache, the entity index and the stores aligned with the cache's rows are rewritten without
  the removed rows.
- add_entities: the entity texts of a file searched over the whole cache and appended to the entity index.

Which store does what is said beside each store's builder; `descriptor.stores()` lists them in the order they run
(the pipeline's: each after the stores it is made from).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

from cfir_jax.builders import corpus_update, descriptor
from cfir_jax.builders.descriptor import AddEntitiesPayload, AddPayload, CompactPayload, Payload, RemovePayload
from cfir_jax.builders.store_update import ChangeRun
from cfir_jax.core.errors import CfirError
from cfir_jax.data.corpus import Corpus
from cfir_jax.stores import versions
from cfir_jax.stores.image_cache import ImageCache
from cfir_jax.stores.integrity import MANIFEST
from cfir_jax.stores.layout import Layout

Say = Callable[[str], None]


def change(config, layout: Layout, op: str, key: dict, payload: Payload, summary: Callable[[ChangeRun], dict],
           say: Say = print) -> dict:
    """Runs the change `op` over every declared store the workdir holds, in pipeline order, and commits it as one new
    version; `key` identifies the input (a rerun with the same key resumes), `payload` is what each step reads,
    `summary` the counts recorded in the history. A refused input (CfirError before anything was staged) leaves
    nothing behind."""
    run = ChangeRun.begin(config, layout, op, key, payload, say)
    pending = run.change
    stores = descriptor.stores()
    try:
        for store in stores:
            step = store.changes.of(op)
            if step is None or not (store.path(layout.root) / MANIFEST).is_file() or \
                    (step.when is not None and not step.when(run)):
                continue
            run.apply(store, step)
    except CfirError:
        if not any(pending.staged(s.name) for s in stores):
            pending.abandon()
        raise
    changes = summary(run)
    version = pending.commit(changes)
    say(f"version {version}: " + ", ".join(f"{k.replace('_', ' ')} {v:,}" for k, v in changes.items()))
    return {"version": version, **changes}


def _opened(workdir) -> Layout:
    layout = Layout.of(workdir)
    versions.recover(layout)
    if not layout.index_json.is_file():
        raise CfirError(f"{layout.root}: no built index here (no index.json); build it with index.py first")
    return layout


def _grown(run: ChangeRun, store: str) -> int:
    """How many rows the change added to `store` (negative: removed; 0 when the workdir holds none)."""
    if not (run.layout.root / store / MANIFEST).is_file():
        return 0
    return len(run.new(store)) - len(run.old(store))


def _stamp(path: Path) -> list:
    """What identifies the input of an add (its path, and each file's size and time): a rerun with the same input
    resumes the staged change, another input starts over."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return [os.fspath(path.absolute()), [[os.fspath(p.relative_to(path) if path.is_dir() else p.name),
                                          p.stat().st_size, p.stat().st_mtime_ns] for p in files]]


def add(config, workdir, path: str | os.PathLike, say: Say = print) -> dict:
    """Appends the documents and images of `path` to the built workdir as one new version; returns what changed."""
    path = Path(path)
    if not path.exists():
        raise CfirError(f"{path}: nothing to add (no such file or directory)")
    key = {"input": _stamp(path)}
    layout = _opened(workdir)
    say(f"adding {path} to {layout.root} (version {versions.current_version(layout)})")

    def summary(run: ChangeRun) -> dict:
        old, new = run.old("image_cache"), run.new("image_cache")
        return {"images_added": new.num_images - old.num_images,
                "images_skipped": len(new.skipped()) - len(old.skipped()),
                "documents_added": corpus_update.documents_added(run),
                "entities_added": _grown(run, "entity_index")}

    return change(config, layout, "add", key, AddPayload(path), summary, say)


def remove(config, workdir, ids_file: str | os.PathLike, say: Say = print) -> dict:
    """Masks the images and documents named in `ids_file` as one new version; returns what changed."""
    layout = _opened(workdir)
    corpus = Corpus.open(layout.corpus)
    images, documents, already = corpus_update.resolve_removals(corpus, Path(ids_file))
    if not images and not documents:
        say(f"nothing to remove: the {len(already)} ids of {ids_file} are removed already")
        return {"version": versions.current_version(layout), "images_removed": 0, "documents_removed": 0}
    say(f"removing {len(images):,} images and {len(documents):,} documents from {layout.root} (version "
        f"{versions.current_version(layout)})")

    def summary(run: ChangeRun) -> dict:
        return {"images_removed": len(images), "documents_removed": len(documents),
                "entities_dropped": -_grown(run, "entity_index"),
                "images_live": run.new("image_cache").num_live}

    return change(config, layout, "remove", {"images": sorted(images), "documents": sorted(documents)},
                  RemovePayload(tuple(images), tuple(documents)), summary, say)


def compact(config, workdir, say: Say = print) -> dict:
    """Rewrites the stores without the removed image rows as one new version; returns what changed."""
    layout = _opened(workdir)
    cache = ImageCache.open(layout.image_cache)
    removed = int(cache.manifest.get("num_removed", 0))
    if not removed:
        say(f"nothing to compact: {layout.image_cache} has no removed rows")
        return {"version": versions.current_version(layout), "rows_dropped": 0}

    def summary(run: ChangeRun) -> dict:
        return {"rows_dropped": removed, "images_live": run.new("image_cache").num_images}

    sha = cache.manifest.get("removed_sha")
    return change(config, layout, "compact", {"removed_sha": sha}, CompactPayload(sha), summary, say)


def add_entities(config, workdir, texts: list[str], say: Say = print) -> dict:
    """Appends entity texts (those not indexed yet) to the built entity index as one new version."""
    layout = _opened(workdir)

    def summary(run: ChangeRun) -> dict:
        return {"entities_added": _grown(run, "entity_index")}

    key = {"entities_sha": hashlib.sha256("\n".join(texts).encode()).hexdigest()[:16]}
    return change(config, layout, "add_entities", key, AddEntitiesPayload(tuple(texts)), summary, say)
