"""The stores retrieval opens only when a method or an option asks for them, each by one `Reader`.

A store's reader module declares it once, beside the reader class, and the store's stage in `cfir_jax.builders`
names the same object as its `reader=` (one declaration for both sides):

    LEXICAL = register(Reader("lexical", LexicalIndex.open, asked=lambda config, method: method.uses_lexical,
                              expect=lambda opened: {"cache_fingerprint": opened.cache.content_fingerprint}))

`asked(config, method)`: whether retrieval opens it for this configuration and method (`cfir_jax.retrieve.methods`);
`expect(opened)`: what its check holds it to, read from the stores retrieval opened before it (`opened.cache`,
`opened.entity_index`, `opened.encoder_fingerprint`: `cfir_jax.retrieve.stores.Stores`). Called as `reader(path)`, a
reader opens the store unchecked (the change loop's readers).

`READERS` finds the registrations by module (`cfir_jax.core.registry`: every module of `stores/`), so a new store is
opened by retrieval with no list to extend. `registering(reader)` adds a registration made elsewhere (a test's toy
store) for the length of a `with` block.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cfir_jax.core.registry import Registry


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


# The stores retrieval opens on request, each registered by its reader module.
READERS: Registry[Reader] = Registry("reader", "stores/*")


def register(reader: Reader) -> Reader:
    """Registers a store retrieval opens on request (at its reader module's import; a second registration of one
    name replaces the first)."""
    return READERS.register(reader)


def registering(*extra: Reader):
    """The readers `extra` registered as well for the length of the block (a test's toy store)."""
    return READERS.extended(*extra)


def optional() -> list[Reader]:
    """Every registered reader, by store name (the order retrieval opens them in)."""
    return [READERS[name] for name in sorted(READERS)]


def get(name: str) -> Reader:
    return READERS[name]
