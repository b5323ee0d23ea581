"""The stores retrieval opens only when a method or an option asks for them, each by one `Reader`.

A store's reader module declares it once, beside the reader class, and the store's declaration in `cfir_jax.builders`
names the same object as its `reader=` (one declaration for both sides):

    LEXICAL = register(Reader("lexical", LexicalIndex.open, asked=lambda config, method: method.uses_lexical,
                              expect=lambda opened: {"cache_fingerprint": opened.cache.content_fingerprint}))

`asked(config, method)`: whether retrieval opens it for this configuration and method (`cfir_jax.retrieve.methods`);
`expect(opened)`: what its check holds it to, read from the stores retrieval opened before it (`opened.cache`,
`opened.entity_index`, `opened.encoder_fingerprint`: `cfir_jax.retrieve.stores.Stores`). Called as `reader(path)`, a
reader opens the store unchecked (the change loop's readers).

`optional()` finds the registrations by module: it imports every module of `cfir_jax.stores`, so a new store is
opened by retrieval with no list to extend. `registering(reader)` adds a registration made elsewhere (a test's toy
store) for the length of a `with` block.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import pkgutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def _nothing(opened: Any) -> dict:
    return {}


@dataclasses.dataclass(frozen=True)
class Reader:
    """How retrieval opens the store W/<name>: `open(path, **expect)` (a `contract.Store`'s `open`), when it is
    `asked(config, method)`, checked against `expect(opened)`."""

    name: str
    open: Callable[..., Any]
    asked: Callable[[Any, Any], bool]
    expect: Callable[[Any], dict] = _nothing

    def __call__(self, path: str | Path, **expect: Any) -> Any:
        return self.open(path, **expect)

    def open_for(self, opened: Any) -> Any:
        """The store of the workdir `opened.layout`, checked against the stores retrieval opened before it."""
        return self.open(opened.layout.root / self.name, **self.expect(opened))


_REGISTERED: dict[str, Reader] = {}
_found: list[str] = []


def register(reader: Reader) -> Reader:
    """Registers a store retrieval opens on request (at its reader module's import; a second registration of one
    name replaces the first)."""
    _REGISTERED[reader.name] = reader
    return reader


@contextlib.contextmanager
def registering(*extra: Reader) -> Iterator[None]:
    """The readers `extra` registered as well for the length of the block (a test's toy store)."""
    _discover()
    before = dict(_REGISTERED)
    for reader in extra:
        register(reader)
    try:
        yield
    finally:
        _REGISTERED.clear()
        _REGISTERED.update(before)


def import_modules(package: str) -> None:
    """Imports every module of `package` once, so each registers what it declares (its readers, its stores): the one
    discovery by module, for this registry and the builders' (`cfir_jax.builders.descriptor.discover`)."""
    if package in _found:
        return
    _found.append(package)
    for module in pkgutil.iter_modules(importlib.import_module(package).__path__):
        importlib.import_module(f"{package}.{module.name}")


def _discover() -> None:
    """Imports every module of cfir_jax.stores once, so each registers its readers."""
    import_modules(__package__)


def optional() -> list[Reader]:
    """Every registered reader, by store name (the order retrieval opens them in)."""
    _discover()
    return [_REGISTERED[name] for name in sorted(_REGISTERED)]


def get(name: str) -> Reader:
    _discover()
    if name not in _REGISTERED:
        raise KeyError(f"no reader of {name!r} is registered ({', '.join(sorted(_REGISTERED))})")
    return _REGISTERED[name]
