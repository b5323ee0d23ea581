"""One declaration per store of the workdir: what it is, what it is made from, how it is built, changed, linked,
checked and opened. Every list of stores is derived from these declarations.

A store's builder module declares it once, at import (`declare`), beside the code it names:

    declare(Store("lexical", order=90, made_from=("corpus", "image_cache"), reader=READER,
                  config="index.lexical", build=Build(build_stage, stage_summary, wanted=...),
                  changes=Changes(add=Step(EXTEND, lexical_after_add),
                                  compact=Step(REMAP, lexical_after_compaction))))

`stores()` finds the declarations by module: it imports every module of `cfir_jax.builders` (as big_vision finds its
models and evaluators by name), so a new store is one new module plus its reader, with no list to extend.
`declaring(store)` adds a declaration made elsewhere (a test's toy store) for the length of a `with` block.

A store that retrieval opens only when a method or an option asks for it (the lexical store above) names as its
`reader` the `cfir_jax.stores.readers.Reader` its reader module registers (`cfir_jax.stores.lexical.READER`): one
object tells both the change loop and retrieval how to open it (retrieval may not import this package).

What derives from them: index.py's stages and their order (`stages`), the stores a rebuild links (`linked`), the
one dependency graph (`graph`) that the closing table's stale rows and the change loop's order both read, the
stores other commands make and how to refresh them (`later`), and every store's directory (`store_names`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from cfir_jax.stores.readers import Reader, import_modules

EXTEND, MASK, REMAP, REBUILD, DROP = "extend", "mask", "remap", "rebuild", "drop"
OPS = ("add", "remove", "compact", "add_entities")


# ----------------------------------------------------------------------------------- what each change carries
@dataclasses.dataclass(frozen=True)
class AddPayload:
    """--add PATH: the documents and images to append (a directory or a file, docs/collection.md)."""

    path: Path


@dataclasses.dataclass(frozen=True)
class RemovePayload:
    """--remove IDS: the image and document ids to mask (resolved against the corpus)."""

    images: tuple[str, ...]
    documents: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class CompactPayload:
    """--compact: the removed rows being dropped, named by the image cache's removed_sha."""

    removed_sha: str | None


@dataclasses.dataclass(frozen=True)
class AddEntitiesPayload:
    """--add-entities FILE: the entity texts to append (those not indexed yet)."""

    texts: tuple[str, ...]


Payload = AddPayload | RemovePayload | CompactPayload | AddEntitiesPayload
PAYLOADS: dict[str, type] = {"add": AddPayload, "remove": RemovePayload, "compact": CompactPayload,
                             "add_entities": AddEntitiesPayload}
# What a change step returns: its counts, each said in the change's log line as it is returned.
Counts = dict[str, int | str]


@dataclasses.dataclass(frozen=True)
class Step:
    """How a store follows one change: `how` (EXTEND, MASK, REMAP, REBUILD or DROP), `run(change, out) -> Counts`
    writing its new version into the empty `out` (None for DROP), `when(change)` (default: always) deciding whether
    it is touched at all, and `note`, a line said when it is dropped."""

    how: str
    run: Callable[[Any, Path], Counts] | None = None
    when: Callable[[Any], bool] | None = None
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Changes:
    """A store's `Step` per change kind (`OPS`); a kind with none leaves the store as it is."""

    add: Step | None = None
    remove: Step | None = None
    compact: Step | None = None
    add_entities: Step | None = None

    def of(self, op: str) -> Step | None:
        return getattr(self, op)


# ------------------------------------------------------------------------------------------- how index.py builds
@dataclasses.dataclass
class StageRun:
    """One run of index.py's stages: the config, the layout it builds in, the stages asked for (of `all_stages`),
    the caption pretraining (`runner.Pretrain`) and what each stage run so far returned (`opened[name]`)."""

    config: Any
    layout: Any  # cfir_jax.stores.layout.Layout
    stages: tuple[str, ...]
    all_stages: tuple[str, ...]
    pretrain: Callable | None = None
    opened: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Build:
    """A store's stage of index.py. `run(stage_run)` builds it (or opens it when current) and returns what later
    stages read; `describe(result)` is its row of the closing table. With `every_host=False` process 0 alone runs
    `run` while the others wait, then every process calls `open`. `wanted(stage_run)`: whether a run that names the
    stage builds it (default: yes). `unselected(stage_run)`: what a run that does not name it opens (still a row);
    None: no row. `check(stage_run, result)`: after the stage, what the next ones rely on. `path(stage_run)`: the
    store's directory when it is not W/<name>."""

    run: Callable[[StageRun], Any]
    describe: Callable[[Any], str]
    every_host: bool = True
    open: Callable[[StageRun], Any] | None = None
    wanted: Callable[[StageRun], bool] | None = None
    unselected: Callable[[StageRun], Any] | None = None
    check: Callable[[StageRun, Any], None] | None = None
    path: Callable[[StageRun], Path] | None = None


@dataclasses.dataclass(frozen=True)
class Store:
    """One store of the workdir (the directory W/<name>). `order`: where it stands in the pipeline (index.py runs
    its stages, and the change loop its steps, in this order; a store stands after every store it is made from).
    `made_from`: the stores it is derived from (the one dependency graph: rebuilding one makes it stale, and its
    change steps read their new versions). `build`: its stage of index.py (None: another command makes it).
    `changes`: its steps per change kind. `linked`: a rebuild links it into its staging directory (every stage's
    store is). `reader(path)`: opens it (a `stores.readers.Reader` for a store retrieval opens on request, the same
object retrieval opens it by). `config`: its config section. `refresh`: the command that refreshes it when
    another command makes it (W stands for the workdir)."""

    name: str
    order: int
    made_from: tuple[str, ...] = ()
    build: Build | None = None
    changes: Changes = Changes()
    linked: bool = False
    reader: Callable[[Path], Any] | None = None
    config: str = ""
    refresh: str = ""

    @property
    def links(self) -> bool:
        return self.linked or self.build is not None

    def path(self, root: str | Path) -> Path:
        return Path(root) / self.name


# ---------------------------------------------------------------------------------------------- the declarations
_DECLARED: dict[str, Store] = {}
_PACKAGES = ("cfir_jax.builders",)


def declare(store: Store) -> Store:
    """Declares a store (at its builder module's import; a second declaration of one name replaces the first)."""
    if isinstance(store.reader, Reader) and store.reader.name != store.name:
        raise ValueError(f"store {store.name!r} names the reader of {store.reader.name!r}")
    _DECLARED[store.name] = store
    return store


@contextlib.contextmanager
def declaring(*extra: Store) -> Iterator[None]:
    """The stores `extra` declared as well for the length of the block (a store declared outside cfir_jax.builders:
    a test's toy store)."""
    discover()
    before = dict(_DECLARED)
    for store in extra:
        declare(store)
    try:
        yield
    finally:
        _DECLARED.clear()
        _DECLARED.update(before)


def discover() -> None:
    """Imports every module of the builder packages once, so each declares its stores."""
    for package in _PACKAGES:
        import_modules(package)


def stores() -> list[Store]:
    """Every declared store, in pipeline order; refused when a store stands before one it is made from."""
    discover()
    ordered = sorted(_DECLARED.values(), key=lambda s: (s.order, s.name))
    seen: set[str] = set()
    for store in ordered:
        early = [d for d in store.made_from if d in _DECLARED and d not in seen]
        if early:
            raise ValueError(f"store {store.name!r} (order {store.order}) is made from {early}, which stand after it")
        seen.add(store.name)
    return ordered


def get(name: str) -> Store:
    discover()
    if name not in _DECLARED:
        raise KeyError(f"no store {name!r} is declared ({', '.join(store_names())})")
    return _DECLARED[name]


def store_names() -> tuple[str, ...]:
    """The directory of every declared store."""
    return tuple(s.name for s in stores())


def stages() -> tuple[str, ...]:
    """index.py's stages, in the order it runs them."""
    return tuple(s.name for s in stores() if s.build is not None)


def linked() -> tuple[str, ...]:
    """The stores a rebuild links into its staging directory: every stage's, and those a stage reads."""
    return tuple(s.name for s in stores() if s.links)


def graph() -> dict[str, tuple[str, ...]]:
    """The one dependency graph: each store -> the stores it is made from."""
    return {s.name: s.made_from for s in stores()}


def later() -> dict[str, str]:
    """The stores other commands make -> the command that refreshes each."""
    return {s.name: s.refresh for s in stores() if s.refresh}
