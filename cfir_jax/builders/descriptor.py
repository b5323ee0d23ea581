"""How index.py builds each store of the workdir and how a change of the collection changes it: one `Stage` per
store, declared once, at the bottom of the module that builds it, beside the code it names:

    declare(Stage("lexical", reader=READER, build=Build(build_stage, stage_summary, wanted=...),
                  changes=Changes(add=Step(EXTEND, lexical_after_add), compact=Step(REMAP, lexical_after_compaction))))

What the store is and what it is made from is its `Directory` (`cfir_jax.stores.layout`), declared in
`cfir_jax/builders/directories.py`, light, so that the layout and the service read it without loading a builder.
`STAGES` finds the stages by module (`cfir_jax.core.registry`: every module of this room), as big_vision finds its
models by name, so a new store is its reader, its builder and its directory, with no list to extend. `declaring(...)`
adds directories and stages made elsewhere (a test's toy store) for the length of a `with` block.

A store that retrieval opens only when a method or an option asks for it (the lexical store above) names as its
`reader` the `cfir_jax.stores.readers.Reader` its reader module registers (`cfir_jax.stores.lexical.READER`): one
object tells both the change loop and retrieval how to open it (retrieval may not import this package).

What derives from them (`stores()`: every directory of the workdir with its stage, in the layout's one order):
index.py's stages and their order (`stages`), the stores a rebuild links (`linked`), the one dependency graph
(`graph`) that the closing table's stale rows and the change loop's order both read, the stores other commands make
and how to refresh them (`later`), and every directory's name (`store_names`).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from cfir_jax.core.registry import Registry, modules_matching
from cfir_jax.stores import layout as workdir_layout
from cfir_jax.stores.layout import Directory
from cfir_jax.stores.readers import Reader

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
class Stage:
    """How the builders make and change the store W/<name> (its `Directory` says what it is and what it is made
    from). `build`: its stage of index.py (None: index.py does not build it). `changes`: its steps per change kind.
    `reader(path)`: opens it for the change steps (a `stores.readers.Reader` for a store retrieval opens on request,
    the same object retrieval opens it by)."""

    name: str
    build: Build | None = None
    changes: Changes = Changes()
    reader: Callable[[Path], Any] | None = None


@dataclasses.dataclass(frozen=True)
class Store:
    """A directory of the workdir with its stage: what `stores()` lists (the `Directory`'s fields and the `Stage`'s)."""

    name: str
    kind: str
    made_from: tuple[str, ...] = ()
    build: Build | None = None
    changes: Changes = Changes()
    linked: bool = False
    reader: Callable[[Path], Any] | None = None
    config: str = ""
    refresh: str = ""

    @property
    def links(self) -> bool:
        """A rebuild links it into its staging directory: every stage's store, and those a stage reads."""
        return self.linked or self.build is not None

    def path(self, root: str | Path) -> Path:
        return Path(root) / self.name


# ---------------------------------------------------------------------------------------------- the declarations
STAGES: Registry[Stage] = Registry("stage of index.py", "builders/*")


def declare(stage: Stage) -> Stage:
    """Declares a store's stage (at its builder module's import; a second declaration of one name replaces the
    first)."""
    if isinstance(stage.reader, Reader) and stage.reader.name != stage.name:
        raise ValueError(f"store {stage.name!r} names the reader of {stage.reader.name!r}")
    return STAGES.register(stage)


@contextlib.contextmanager
def declaring(*extra: Directory | Stage) -> Iterator[None]:
    """The directories and stages `extra` declared as well for the length of the block (a store declared outside
    cfir_jax.builders: a test's toy store)."""
    directories = [e for e in extra if isinstance(e, Directory)]
    stages = [e for e in extra if isinstance(e, Stage)]
    with workdir_layout.DIRECTORIES.extended(*directories), STAGES.extended(*stages):
        yield


def stores() -> list[Store]:
    """Every directory of the workdir with its stage, in the layout's order (each after what it is made from, ties
    broken by name); a stage of an undeclared directory is refused."""
    ordered = workdir_layout.ordered()
    unknown = sorted(set(STAGES) - {d.name for d in ordered})
    if unknown:
        raise ValueError(f"stages of undeclared directories {unknown}: declare each in its room's `directories`")
    out = []
    for d in ordered:
        stage = STAGES.get(d.name) or Stage(d.name)
        out.append(Store(d.name, d.kind, d.made_from, stage.build, stage.changes, d.linked, stage.reader, d.config,
                         d.refresh))
    return out


def get(name: str) -> Store:
    found = [s for s in stores() if s.name == name]
    if not found:
        raise KeyError(f"no store {name!r} is declared ({', '.join(store_names())})")
    return found[0]


def store_names() -> tuple[str, ...]:
    """The directory of every declared store and run."""
    return tuple(s.name for s in stores())


def stages() -> tuple[str, ...]:
    """index.py's stages, in the order it runs them."""
    return tuple(s.name for s in stores() if s.build is not None)


def stages_unimported() -> tuple[str, ...]:
    """`stages()` read from the builder modules' source, none imported (they load JAX): what `index.py --help` lists.
    A declaration `declare(Stage("name", ..., build=...))` with its name a literal counts; tests/unit/core/test_cli.py
    checks the list against `stages()`."""
    built = set()
    for module in modules_matching(STAGES.where):
        path = Path(__file__).resolve().parent.parent.joinpath(*module.split(".")[1:]).with_suffix(".py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "Stage" \
                    and node.args and isinstance(node.args[0], ast.Constant) \
                    and any(k.arg == "build" for k in node.keywords):
                built.add(node.args[0].value)
    return tuple(d.name for d in workdir_layout.ordered() if d.name in built)


def linked() -> tuple[str, ...]:
    """The stores a rebuild links into its staging directory: every stage's, and those a stage reads."""
    return tuple(s.name for s in stores() if s.links)


def graph() -> dict[str, tuple[str, ...]]:
    """The one dependency graph: each store -> the stores it is made from."""
    return {s.name: s.made_from for s in stores()}


def later() -> dict[str, str]:
    """The stores other commands make -> the command that refreshes each."""
    return {s.name: s.refresh for s in stores() if s.refresh}
