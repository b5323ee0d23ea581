"""One change of the collection being staged (`ChangeRun`): what each store's change step reads and writes.

Each store declares its steps per change kind in its own builder module (`cfir_jax.builders.descriptor`: a `Step` per
kind, each saying how the store follows it: extend, mask, remap, rebuild or drop). A step is
`run(change: ChangeRun, out: Path) -> Counts`: it reads the old stores with `change.old(name)`, the versions this
change staged before it with `change.new(name)` and what was asked with `change.payload` (one payload class per
change kind: `AddPayload`, `RemovePayload`, `CompactPayload`, `AddEntitiesPayload`), writes the store's new version
into the empty `out` and returns its counts, which the change's log line says as they are. A removal masks rows in
the corpus, the image caches and the entity index and re-keys the entity-text matches; the other stores (lexical,
image text, the compact copies) keep the removed rows, and the query side drops them (`cfir_jax.search.live_rows`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from cfir_jax.builders import descriptor
from cfir_jax.builders.descriptor import DROP, PAYLOADS, Counts, Payload, Step, Store
from cfir_jax.stores import versions
from cfir_jax.stores.layout import Layout


class ChangeRun:
    """One change being staged: the config, the workdir, what was asked (`op`, `payload`), the `versions.Change`
    and a `work` directory kept until the commit (encoded shards, NER chunks: a rerun resumes from them)."""

    def __init__(self, config, layout: Layout, op: str, payload: Payload, change: versions.Change,
                 say: Callable[[str], None]):
        self.config, self.layout, self.op, self.payload = config, layout, op, payload
        self.change, self.say = change, say
        self.work = change.directory / "work"
        self.work.mkdir(parents=True, exist_ok=True)
        self.infos: dict[str, dict] = {}
        self._opened: dict[Path, Any] = {}

    @classmethod
    def begin(cls, config, layout: Layout, op: str, key: dict, payload: Payload, say: Callable[[str], None]
              ) -> ChangeRun:
        """Starts the change `op` of the workdir on its current version, or resumes the one staged with this `key`."""
        if not isinstance(payload, PAYLOADS[op]):
            raise TypeError(f"a {op} change carries a {PAYLOADS[op].__name__}, not {type(payload).__name__}")
        change = versions.begin(layout, op, {**key, "base_version": versions.current_version(layout)})
        return cls(config, layout, op, payload, change, say)

    def _open(self, store: str, path: Path) -> Any:
        if path not in self._opened:
            self._opened[path] = descriptor.get(store).reader(path)
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

    def apply(self, store: Store, step: Step) -> None:
        """Stages `store` by `step` (once: a rerun of the same change reuses what an earlier run staged)."""
        name = store.name
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


def describe(counts: Counts) -> str:
    """A step's counts as the change's log line says them: every one it returned, in its order."""
    return ", ".join(f"{k.replace('_', ' ')} {v:,}" if isinstance(v, int) else f"{k.replace('_', ' ')} {v}"
                     for k, v in counts.items()) or "staged"
