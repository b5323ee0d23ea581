"""The package's imports follow the pipeline: no module imports a later stage, retrieval never imports a builder."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "cfir_jax"

# Stage of each part of the package, in pipeline order. A module may import its own stage and earlier ones only.
# The floor (errors, atomic writes, the store contract and its integrity checks, faults, the writer lock, the workdir
# layout, config defaults and the upgrade of an older workdir's config, CLI helpers) and evaluation (pure metrics,
# TREC I/O and the comparison rows, used by the trainer's validation and retrieval) sit below everything; the search
# layer (exact top-k, the SR scorers, the device-resident cache, the fused view) sits on the floor, below the index
# that builds with it and the retrieval that scores with it; training and retrieval are siblings over the index; the
# index runner (`cfir_jax.index.runner`, inside index/ by its place) is the runner over the whole build (it calls the
# index stages and the synthetic world's caption pretraining), so it ranks above them. `serve` is the HTTP service
# over retrieval (nothing below imports it). `aot` (compile-only) sits above every stage: it compiles their
# accelerator programs, and no stage imports it (the commands do, for --compile-only).
RANKS = {"floor": 0, "eval": 0, "search": 1, "model": 1, "data": 1, "index": 2, "train": 3, "retrieve": 3,
         "runner": 4, "serve": 4, "aot": 5}
FLOOR = {"errors", "atomic_write", "store", "layout", "config", "config_upgrade", "cli", "progress", "hosts", "faults",
         "integrity", "workdir_lock"}
RUNNER = "cfir_jax.index.runner"
# Retrieval reads stores and the model: these builders are never its business (it opens the entity index through
# its reader, `cfir_jax.stores.entity_index`).
NOT_FOR_RETRIEVAL = (RUNNER, "cfir_jax.train", "cfir_jax.index.entity_index_build")


def _part(module: str) -> str:
    if module == RUNNER:
        return "runner"
    top = module.split(".")[1] if module.count(".") else "floor"
    return "floor" if top in FLOOR or top == "__init__" else top


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("cfir_jax"):
            found.update(f"{node.module}.{a.name}" if node.module == "cfir_jax" else node.module for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("cfir_jax"))
    return found


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(p for p in parts if p != "__init__")] = path
    return out


def test_every_module_has_a_known_stage():
    unknown = {m for m in _modules() if _part(m) not in RANKS}
    assert not unknown, f"modules outside the pipeline's stages: {sorted(unknown)}"


def test_imports_point_down_the_pipeline():
    upward = []
    for module, path in _modules().items():
        for target in _imports(path):
            if RANKS[_part(target)] > RANKS[_part(module)]:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports against the pipeline:\n" + "\n".join(sorted(upward))


def test_training_and_retrieval_do_not_import_each_other():
    crossing = [f"{m} -> {t}" for m, p in _modules().items() for t in _imports(p)
                if {_part(m), _part(t)} == {"train", "retrieve"}]
    assert not crossing, "\n".join(crossing)


def test_retrieval_never_imports_a_builder():
    bad = [f"{m} -> {t}" for m, p in _modules().items() if _part(m) in ("retrieve", "serve") for t in _imports(p)
           if t.startswith(NOT_FOR_RETRIEVAL)]
    assert not bad, "\n".join(bad)


def test_the_search_layer_imports_no_stage():
    """Search sits below the index and retrieval that both use it: it stands on the floor alone."""
    bad = [f"{m} -> {t}" for m, p in _modules().items() if _part(m) == "search" for t in _imports(p)
           if _part(t) not in ("floor", "search")]
    assert not bad, "\n".join(bad)


def test_the_index_builder_and_retrieval_share_the_search_layer():
    """One exact top-k, one SR: the entity index's builder and retrieval both import the search layer, and neither
    index/ nor retrieve/ keeps a scorer of its own (no jitted or numpy top-k outside search/)."""
    modules = _modules()
    builder = ("cfir_jax.index.entity_index_build", "cfir_jax.index.candidate_search")  # the build and its search
    assert any(_part(t) == "search" for m in builder for t in _imports(modules[m]))
    assert any(_part(t) == "search" for m, p in modules.items() if _part(m) == "retrieve" for t in _imports(p))
    own = [m for m, p in modules.items() if _part(m) in ("index", "retrieve") and "jax.lax.top_k" in p.read_text()]
    assert not own, f"exact top-k outside the search layer: {own}"
