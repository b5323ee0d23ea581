"""A new store is its reader, its builder with its stage, and its directory: this module declares a toy store (the L2
norm of every image cache row) and nothing else in the repository names it. It follows the steps of docs/architecture.md
("How to add a store"): index.py builds it after the image cache, the closing table marks it stale when the image
cache is rebuilt, an add extends it, a compaction remaps it, a rebuild links it (and so reuses it), `--verify` checks
it, its reader opens it, and retrieval opens it when its option asks for it (`retrieve.stores.open_asked`, the
opening `open_stores` runs)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from cfir_jax.builders import collection_update, descriptor, runner
from cfir_jax.builders.descriptor import EXTEND, REMAP, Build, Changes, Stage, Step
from cfir_jax.builders.image_cache_update import row_map
from cfir_jax.builders.stage_report import report_table
from cfir_jax.commands import verify
from cfir_jax.data.corpus import Document, Image
from cfir_jax.data.corpus_writer import write_corpus
from cfir_jax.retrieve.methods import method_of
from cfir_jax.retrieve.stores import open_asked
from cfir_jax.stores import contract, readers
from cfir_jax.stores.image_cache import ImageCache
from cfir_jax.stores.layout import Directory, Layout
from configs.base import get_config

DIM = 8


# ------------------------------------------------------------------- step 1: the reader (in stores/ for a real store)
class ToyStore(contract.Store):
    """W/toy: norms.npy, float32 [N], the L2 norm of each image cache row."""

    KIND, VERSION = "toy", 1

    @classmethod
    def load(cls, directory: Path, manifest: dict) -> ToyStore:
        store = cls()
        store.directory, store.manifest = directory, manifest
        store.norms = np.load(directory / "norms.npy")
        return store


# ------------------------------------------------------------ step 2: the builder and its steps (in builders/<name>.py)
def _write(out: Path, cache) -> dict:
    norms = np.linalg.norm(np.asarray(cache.embeddings, np.float32), axis=1).astype(np.float32)
    np.save(out / "norms.npy", norms)
    contract.write_manifest(out, ToyStore.KIND, ToyStore.VERSION, cache_fingerprint=cache.content_fingerprint,
                            rows=len(norms))
    return {"rows": len(norms)}


def build_toy(run) -> ToyStore:
    cache, path = run.opened["image_cache"], run.layout.root / "toy"
    try:
        return ToyStore.open(path, cache_fingerprint=cache.content_fingerprint)  # current: reused
    except contract.StoreError:
        with contract.atomic_dir(path) as tmp:
            _write(tmp, cache)
        return ToyStore.open(path)


def toy_after_add(change, out: Path) -> dict:
    old, cache = change.old("toy"), change.new("image_cache")
    new = np.linalg.norm(np.asarray(cache.embeddings[len(old.norms):], np.float32), axis=1).astype(np.float32)
    np.save(out / "norms.npy", np.concatenate([old.norms, new]))
    contract.write_manifest(out, ToyStore.KIND, ToyStore.VERSION, cache_fingerprint=cache.content_fingerprint,
                            rows=len(old.norms) + len(new))
    return {"rows_added": len(new)}


def toy_after_compaction(change, out: Path) -> dict:
    old, cache = change.old("toy"), change.new("image_cache")
    norms = old.norms[row_map(change) >= 0]
    np.save(out / "norms.npy", norms)
    contract.write_manifest(out, ToyStore.KIND, ToyStore.VERSION, cache_fingerprint=cache.content_fingerprint,
                            rows=len(norms))
    return {"rows_before": len(old.norms), "rows_after": len(norms)}


# Retrieval opens it when retrieval.toy is set, held to the image cache it was made from.
TOY_READER = readers.Reader("toy", ToyStore.open, asked=lambda config, method: bool(config.retrieval.get("toy")),
                            expect=lambda opened: {"cache_fingerprint": opened.cache.content_fingerprint})


# The stage, at the bottom of the builder's module.
TOY = Stage("toy", reader=TOY_READER, build=Build(build_toy, lambda t: f"{len(t.norms):,} norms"),
            changes=Changes(add=Step(EXTEND, toy_after_add), compact=Step(REMAP, toy_after_compaction)))


# ------------------------------------------------------------- step 3: the directory (in builders/directories.py)
TOY_DIRECTORY = Directory("toy", made_from=("image_cache",), about="the L2 norm of every image cache row")


# ------------------------------------------------------------------------------------------------------ the test
def _images(ids, seed):
    rng = np.random.default_rng(seed)
    return [Image(i, embedding=rng.standard_normal(DIM).astype(np.float32)) for i in ids]


def _config(dtype="float16"):
    c = get_config("runlocal")
    c.model.embed_dim = DIM
    c.index.image_cache.update(precomputed="corpus", dtype=dtype)
    return c


def _norms(layout: Layout) -> np.ndarray:
    return np.load(layout.root / "toy" / "norms.npy")


def _cache_norms(layout: Layout) -> np.ndarray:
    emb = np.load(layout.image_cache / "embeddings.npy").astype(np.float32)
    return np.linalg.norm(emb, axis=1).astype(np.float32)


@pytest.fixture
def declared():
    with descriptor.declaring(TOY_DIRECTORY, TOY), readers.registering(TOY_READER):
        yield


def test_a_toy_store_declared_here_is_built_staled_changed_linked_verified_and_opened(tmp_path, declared, capsys):
    layout = Layout.of(tmp_path / "W")
    write_corpus(layout.corpus, "toy", [Document("d0", "a text")], _images([f"i{k}" for k in range(6)], 0), {})
    assert "toy" in runner.stages() and "toy" in descriptor.linked()

    # built: the toy store's stage runs after the image cache it reads (the stages in the layout's order: each after
    # what it is made from, ties broken by name)
    reports = runner.build_index(_config(), layout.root, ("image_cache", "toy"), log=lambda line: None)
    names = [r.name for r in reports]  # the corpus and the entities have a row in every run (opened, or "-")
    assert names == ["corpus", "entities", "image_cache", "toy"] and reports[-1].count == "6 norms"
    np.testing.assert_array_equal(_norms(layout), _cache_norms(layout))

    # linked on rebuild: a second build of the built workdir finds it in its staging directory, current
    again = runner.build_index(_config(), layout.root, ("image_cache", "toy"), log=lambda line: None)
    assert [r.name for r in again] == names and all(r.reused for r in again)

    # staled by a change of what it is made from: the image cache rebuilt (another dtype), the toy store not run
    stale = runner.build_index(_config("float32"), layout.root, ("image_cache",), log=lambda line: None)
    assert stale[-1].name == "toy" and stale[-1].stale_because == "image_cache rebuilt"
    assert "stale: toy (image_cache rebuilt); refresh with: python index.py" in report_table(stale)
    runner.build_index(_config("float32"), layout.root, ("toy",), log=lambda line: None)
    np.testing.assert_array_equal(_norms(layout), _cache_norms(layout))

    # extended on add: the added images' rows appended, after the image cache was staged
    add = tmp_path / "add.jsonl"
    add.write_text("".join(json.dumps({"id": img.image_id, "bytes": "", "embedding": img.embedding.tolist()}) + "\n"
                           for img in _images(["n0", "n1"], 1)))
    collection_update.add(_config("float32"), layout.root, add)
    assert "toy: extend, rows added 2" in capsys.readouterr().out
    assert len(_norms(layout)) == 8
    np.testing.assert_array_equal(_norms(layout), _cache_norms(layout))

    # remapped on compact: the removed rows dropped from it as from the cache
    (tmp_path / "ids.txt").write_text("i1\nn0\n")
    collection_update.remove(_config("float32"), layout.root, tmp_path / "ids.txt")
    collection_update.compact(_config("float32"), layout.root)
    assert "toy: remap, rows before 8, rows after 6" in capsys.readouterr().out
    np.testing.assert_array_equal(_norms(layout), _cache_norms(layout))

    # verified and opened
    assert verify.run(layout.root) == 0 and "toy" in capsys.readouterr().out
    store = TOY.reader(layout.root / "toy")
    assert store.manifest["rows"] == 6 and len(store.norms) == 6
    _opened_by_retrieval(layout)


def _opened_by_retrieval(layout: Layout) -> None:
    """Retrieval's opening of the stores asked for: none without the option, the toy store with it, refused when
    the image cache it was made from has changed since."""
    config = _config("float32")
    opened = SimpleNamespace(layout=layout, cache=ImageCache.open(layout.image_cache), extra={})
    open_asked(config, method_of("dense_summary", config.retrieval), opened)
    assert opened.extra == {}
    config.retrieval.toy = True
    open_asked(config, method_of("dense_summary", config.retrieval), opened)
    np.testing.assert_array_equal(opened.extra["toy"].norms, _cache_norms(layout))
    opened.cache = SimpleNamespace(content_fingerprint="another cache")
    with pytest.raises(contract.StoreError, match="cache_fingerprint"):
        open_asked(config, method_of("dense_summary", config.retrieval), opened)


def test_a_declaration_ends_with_its_block(declared):
    assert "toy" in descriptor.store_names() and readers.get("toy") is TOY_READER


def test_without_the_declaration_no_list_names_the_toy_store():
    assert "toy" not in descriptor.store_names() and "toy" not in runner.stages()
    assert "toy" not in [r.name for r in readers.optional()]
