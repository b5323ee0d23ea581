"""The one registry mechanism: the things the system has several of (the workdir's directories, index.py's stages,
the readers retrieval opens on request, retrieval's methods, the serving engines, the compile-only programs), each
declared once beside its code and found by name, as big_vision finds its models.

A registry holds one kind of thing, by name. Its entries register themselves when the module that declares them is
imported (`REGISTRY.register(entry)`, or `@REGISTRY.register` on a class or function with a `name`), and the registry
finds those modules by their names: `where` is a pattern over the package's modules, written `room/module`, e.g.
`"stores/*"` (every module of `stores/`) or `"*/directories"` (the module `directories` of every room). A pattern
names modules by their place in the tree, never a room above the registry's own: a registry that a lower floor reads
and higher floors fill (the workdir's directories, read by the layout) finds its declarations through a wildcard
room, so nothing on a lower floor names a higher module by string (tests/unit/test_architecture.py). Listing the
modules reads file names only; the matching modules are imported once, on the first lookup.

A registry is a read-only mapping from names to entries in the order they registered: `REGISTRY[name]` (an unknown
name is a `KeyError` that lists the known ones), `name in REGISTRY`, `list(REGISTRY)`, `REGISTRY.values()`.
`REGISTRY.extended(entry, ...)` adds entries made elsewhere (a test's toy store) for the length of a `with` block.
"""

from __future__ import annotations

import contextlib
import fnmatch
import importlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Generic, TypeVar

T = TypeVar("T")
PACKAGE = "cfir_jax"
_ROOT = Path(__file__).resolve().parent.parent  # the package's folder: its rooms are the folders beneath


class UnknownName(KeyError):
    """A name no entry of the registry has; its message lists the known ones."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def modules_matching(where: str) -> list[str]:
    """The package's modules whose `room/module` matches the pattern `where`, sorted (read from the file tree: nothing
    is imported)."""
    out = []
    for path in sorted(_ROOT.glob("*/*.py")):
        if path.stem != "__init__" and (path.parent / "__init__.py").is_file() and \
                fnmatch.fnmatchcase(f"{path.parent.name}/{path.stem}", where):
            out.append(f"{PACKAGE}.{path.parent.name}.{path.stem}")
    return out


class Registry(Mapping[str, T], Generic[T]):
    """The entries of one `kind` (a word for the messages: "method", "serving engine"), each named by `name_of(entry)`
    (its `name` attribute by default), declared in the modules that match `where`."""

    def __init__(self, kind: str, where: str, name_of: Callable[[T], str] = lambda entry: entry.name):
        self.kind, self.where, self._name_of = kind, where, name_of
        self._entries: dict[str, T] = {}
        self._found = False

    def register(self, entry: T) -> T:
        """Registers `entry` under its name (a second registration of one name replaces the first); returns it, so
        it serves as a decorator."""
        self._entries[self._name_of(entry)] = entry
        return entry

    def find(self) -> None:
        """Imports the modules that declare this registry's entries, once."""
        if self._found:
            return
        self._found = True
        for module in modules_matching(self.where):
            importlib.import_module(module)

    def __getitem__(self, name: str) -> T:
        self.find()
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownName(f"no {self.kind} {name!r} is declared (the {self.kind}s: "
                              f"{', '.join(self._entries) or 'none'})") from None

    def __iter__(self) -> Iterator[str]:
        self.find()
        return iter(list(self._entries))

    def __len__(self) -> int:
        self.find()
        return len(self._entries)

    def __contains__(self, name: Any) -> bool:
        self.find()
        return name in self._entries

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.where!r})"

    @contextlib.contextmanager
    def extended(self, *entries: T) -> Iterator[None]:
        """The registry with `entries` as well for the length of the block (a test's toy store)."""
        self.find()
        before = dict(self._entries)
        for entry in entries:
            self.register(entry)
        try:
            yield
        finally:
            self._entries.clear()
            self._entries.update(before)
