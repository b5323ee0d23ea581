"""One registry mechanism (`cfir_jax.core.registry`): entries found by the names of the modules that declare them,
an unknown name answered with the known ones, entries added for a block; and every registry of the package is one."""

from __future__ import annotations

import dataclasses

import pytest

from cfir_jax.core import registry
from cfir_jax.core.registry import Registry, UnknownName


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str


def test_the_modules_are_found_by_their_names_in_any_room():
    assert "cfir_jax.stores.layout" in registry.modules_matching("stores/*")
    assert registry.modules_matching("*/serve") == ["cfir_jax.cluster.serve", "cfir_jax.commands.serve"]
    assert registry.modules_matching("*/no_such_module") == []


def test_a_registry_is_a_mapping_in_the_order_of_registration():
    found = Registry("toy", "*/no_such_module")
    b, a = found.register(Entry("b")), found.register(Entry("a"))
    assert list(found) == ["b", "a"] and found["a"] is a and "b" in found and b in found.values()
    assert found.get("c") is None and len(found) == 2


def test_an_unknown_name_lists_the_known_ones():
    found = Registry("toy", "*/no_such_module")
    found.register(Entry("cfir"))
    with pytest.raises(UnknownName, match=r"^no toy 'cifr' is declared \(the toys: cfir\)$"):
        found["cifr"]


def test_entries_added_for_a_block_go_with_it():
    found = Registry("toy", "*/no_such_module")
    found.register(Entry("kept"))
    with found.extended(Entry("toy"), Entry("kept")):
        assert list(found) == ["kept", "toy"]
    assert list(found) == ["kept"]


def test_every_registry_of_the_package_is_one_mechanism():
    """The workdir's directories, index.py's stages, the readers, the methods, the serving engines and the
    compile-only units: each a `Registry`, found by module names, each entry by its name."""
    from cfir_jax.aot import programs
    from cfir_jax.builders import descriptor
    from cfir_jax.core.config_check import SERVE_ENGINES
    from cfir_jax.retrieve.methods import METHODS
    from cfir_jax.stores.layout import DIRECTORIES
    from cfir_jax.stores.readers import READERS

    for found in (DIRECTORIES, descriptor.STAGES, READERS, METHODS, SERVE_ENGINES, programs.UNITS):
        assert isinstance(found, Registry) and len(found) >= 2, found
    assert "train_full" in DIRECTORIES and "corpus" in descriptor.STAGES and "lexical" in READERS
    assert sorted(SERVE_ENGINES) == ["local", "ray"] and "cfir" in METHODS and "train/train_full" in programs.UNITS
