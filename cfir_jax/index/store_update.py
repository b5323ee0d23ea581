"""What each store does after a change of the collection, and the registry the one change loop runs over.

A store's module (beside its builder in `cfir_jax.index`) registers one `StoreUpdate`: for each change (`add`,
`remove`, `compact`, `add_entities`) a `Step` saying how the store follows it (extend, mask, remap, rebuild, or
drop) and the function that writes its new version into an empty staging directory. A store with no step for a
change is left as it is. `cfir_jax.index.collection_update` runs every registered store in dependency order
(`after`) through one `versions.Change`; a new store is one `register(...)` call in its own module:

    register(StoreUpdate("lexical", open=LexicalIndex.open, after=("corpus",),
                         add=Step(EXTEND, _lexical_after_add), remove=Step(MASK, _lexical_after_removal)))

A step is `run(change: ChangeRun, out: Path) -> dict | None` (counts, said in the change's log line); it reads the
old stores with `change.old(name)` and the versions this change staged before it with `change.new(name)`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from cfir_jax.stores import versions
from cfir_jax.stores.integrity import MANIFEST
from cfir_jax.stores.layout import Layout

EXTEND, MASK, REMAP, REBUILD, DROP = "extend", "mask", "remap", "rebuild", "drop"
OPS = ("add", "remove", "compact", "add_entities")


@dataclasses.dataclass(frozen=True)
class Step:
    """How a store follows one change: `how` (EXTEND, MASK, REMAP, REBUILD or DROP), `run` writing its new version
    (None for DROP), `when` (default: always) deciding from the change whether it is touched at all, and `note`, a
    line said when it is dropped."""

    how: str
    run: Callable[[ChangeRun, Path], dict | None] | None = None
    when: Callable[[ChangeRun], bool] | None = None
    note: str = ""


@dataclasses.dataclass(frozen=True)
class StoreUpdate:
    """One store of the workdir under changes: its name (a `Layout` store), its reader's `open(path)`, the stores
    whose new versions its steps read (`after`), and a `Step` per change it follows."""

    store: str
    open: Callable[[Path], Any] | None = None
    after: tuple[str, ...] = ()
    add: Step | None = None
    remove: Step | None = None
    compact: Step | None = None
    add_entities: Step | None = None

    def present(self, layout: Layout) -> bool:
        """Whether the workdir holds a complete version of this store (a change touches only those)."""
        return (layout.root / self.store / MANIFEST).is_file()


_REGISTRY: dict[str, StoreUpdate] = {}


def register(update: StoreUpdate) -> StoreUpdate:
    """Adds a store to the change loop (once per store: a second registration of one name replaces the first)."""
    _REGISTRY[update.store] = update
    return update


def registered() -> list[StoreUpdate]:
    """Every registered store, each after the stores it reads (registration order otherwise)."""
    done: dict[str, StoreUpdate] = {}

    def visit(update: StoreUpdate, path: tuple[str, ...]) -> None:
        if update.store in done:
            return
        if update.store in path:
            raise ValueError(f"stores read each other round: {' -> '.join((*path, update.store))}")
        for name in update.after:
            if name in _REGISTRY:
                visit(_REGISTRY[name], (*path, update.store))
        done[update.store] = update

    for update in list(_REGISTRY.values()):
        visit(update, ())
    return list(done.values())


class ChangeRun:
    """One change being staged: the config, the workdir, what was asked (`op`, `payload`), the `versions.Change`
    and a `work` directory kept until the commit (encoded shards, NER chunks: a rerun resumes from them)."""

    def __init__(self, config, layout: Layout, op: str, payload: Any, change: versions.Change,
                 say: Callable[[str], None]):
        self.config, self.layout, self.op, self.payload = config, layout, op, payload
        self.change, self.say = change, say
        self.work = change.directory / "work"
        self.work.mkdir(parents=True, exist_ok=True)
        self.infos: dict[str, dict] = {}
        self._opened: dict[Path, Any] = {}

    @classmethod
    def begin(cls, config, layout: Layout, op: str, key: dict, payload: Any, say: Callable[[str], None]
              ) -> ChangeRun:
        """Starts the change `op` of the workdir on its current version, or resumes the one staged with this `key`."""
        change = versions.begin(layout, op, {**key, "base_version": versions.current_version(layout)})
        return cls(config, layout, op, payload, change, say)

    def _open(self, store: str, path: Path) -> Any:
        if path not in self._opened:
            self._opened[path] = _REGISTRY[store].open(path)
        return self._opened[path]

    def old(self, store: str) -> Any:
        """The store as the workdir holds it now (opened once)."""
        return self._open(store, self.layout.root / store)

    def new(self, store: str) -> Any:
        """The store as it will be after this change: the version it staged, else the one the workdir holds."""
        staged = self.change.staged(store)
        return self._open(store, staged) if staged is not None else self.old(store)

    def keep(self, name: str, array: np.ndarray) -> None:
        """Keeps an array that later steps read (a compaction's row map) with the change, across a rerun."""
        np.save(self.work / f"{name}.npy", array)

    def kept(self, name: str) -> np.ndarray:
        return np.load(self.work / f"{name}.npy")

    def apply(self, update: StoreUpdate, step: Step) -> None:
        """Stages `update`'s store by `step` (once: a rerun of the same change reuses what an earlier run staged)."""
        name = update.store
        if step.how == DROP:
            self.change.drop(name)
            self.say(f"  {name}: dropped{step.note and f' ({step.note})'}")
            return
        if self.change.staged(name) is not None:
            self.say(f"  {name}: staged by an earlier run, reused")
            return
        t0 = time.perf_counter()
        with self.change.stage(name) as tmp:
            info = step.run(self, tmp) or {}
        self.say(f"  {name}: {step.how}, {describe(info)} ({time.perf_counter() - t0:.1f} s)")
        self.infos[name] = info


# What a step's info says about the change (the rest is its manifest).
_COUNTS = ("documents_added", "images_added", "judgements_added", "images_encoded", "images_skipped",
           "entities_added", "added_images", "added_entities", "images_removed", "documents_removed",
           "rows_removed", "removed_images", "removed_entities", "refilled_lists", "rows_before", "rows_after",
           "dropped_rows", "searcher", "pairs", "rows", "with_text")


def describe(info: dict) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {v:,}" if isinstance(v, int) else f"{k.replace('_', ' ')} {v}"
                     for k, v in info.items() if k in _COUNTS) or "staged"
