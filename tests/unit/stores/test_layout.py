"""The workdir's directories, each declared once by the room that makes it (`cfir_jax.stores.layout`): the layout
refuses a name none declares, the training runs are no stores (what `--verify` checks is derived from the
declarations), and the order of the pipeline is derived from `made_from`."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from workdirs import full_trained, write_store

from cfir_jax.core import registry
from cfir_jax.stores import layout as workdir_layout
from cfir_jax.stores.integrity import verify_workdir
from cfir_jax.stores.layout import DERIVED, RUN, STORE, Directory, Layout


def test_a_misspelt_directory_is_an_error_not_a_path(tmp_path):
    layout = Layout.of(tmp_path)
    assert layout.image_cache == tmp_path.absolute() / "image_cache"
    with pytest.raises(AttributeError, match="'image_cahe' is no directory of the workdir.*image_cache"):
        layout.image_cahe  # noqa: B018


def test_every_directory_is_declared_once_by_the_room_that_makes_it():
    rooms = {module.split(".")[1] for module in registry.modules_matching("*/directories")}
    assert rooms == {"builders", "training", "rerank", "retrieve"}  # found by the module's name, in any room
    kinds = {d.name: d.kind for d in workdir_layout.ordered()}
    assert {name for name, kind in kinds.items() if kind == RUN} == {"pretrain", "train", "train_document",
                                                                       "train_full"}
    assert kinds["model_full"] == kinds["reranker"] == kinds["encoder"] == STORE
    assert {name for name, kind in kinds.items() if kind == DERIVED} == {"sr_compact", "sr_compact_fused"}


def test_the_order_follows_made_from_and_then_the_names():
    order = [d.name for d in workdir_layout.ordered()]
    for directory in workdir_layout.ordered():
        for source in directory.made_from:
            assert order.index(source) < order.index(directory.name), (source, directory.name)
    assert order[:3] == ["corpus", "entities", "image_cache"]  # the two made from the corpus alone: by name


def test_a_directory_declared_for_a_block_is_a_path_in_it_only(tmp_path):
    with workdir_layout.DIRECTORIES.extended(Directory("toy_notes", made_from=("corpus",))):
        assert Layout.of(tmp_path).toy_notes == tmp_path.absolute() / "toy_notes"
    with pytest.raises(AttributeError, match="toy_notes"):
        Layout.of(tmp_path).toy_notes  # noqa: B018


def test_a_name_that_cannot_be_a_directory_is_refused_at_its_declaration():
    with pytest.raises(ValueError, match="cannot name a directory"):
        Directory("Image-Cache")
    with pytest.raises(ValueError, match="kind 'checkpoint'"):
        Directory("notes", kind="checkpoint")


def test_a_workdir_where_full_training_ran_verifies_intact(tmp_path):
    """W/train_full is a training run (checkpoints, no manifest): the verifier checks the stores beside it only."""
    w = full_trained(tmp_path / "W")
    stores = Layout.of(w).store_dirs()
    assert stores == ("corpus", "model_full")
    assert verify_workdir(w, stores) == (["corpus", "model_full"], [])


def test_an_undeclared_directory_is_not_taken_for_a_store(tmp_path):
    """A folder of the user's beside the stores (W/notes) is no store to verify, and a damaged store still is."""
    w = full_trained(tmp_path / "W")
    (w / "notes").mkdir()
    write_store(w, "entities")
    (w / "entities" / "data.bin").write_bytes(b"ROWS")
    intact, problems = verify_workdir(w, Layout.of(w).store_dirs())
    assert intact == ["corpus", "model_full"] and len(problems) == 1 and "entities/data.bin: damaged" in problems[0]


PACKAGE = Path(workdir_layout.__file__).resolve().parents[1]


def _literals(path: Path):
    """(line, the strings of one tuple, list, set or dict literal, or one string) of a file's code."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items = node.elts
        elif isinstance(node, ast.Dict):
            items = [k for k in node.keys if k is not None]
        else:
            continue
        yield node.lineno, [e.value for e in items if isinstance(e, ast.Constant) and isinstance(e.value, str)]


def _run_lists(paths, runs: set[str]) -> list[str]:
    return [f"{path.parent.name}/{path.name}:{line} {names}" for path in paths
            if path.name != "directories.py" for line, names in _literals(path) if len(set(names) & runs) >= 2]


def test_no_literal_names_the_training_runs_outside_their_declarations(tmp_path):
    """The runs are declared once (`cfir_jax/training/directories.py`); a hand-kept list of them elsewhere (the
    verifier's and the service's once, which missed train_full) is what goes stale."""
    runs = set(workdir_layout.of_kind(RUN))
    found = _run_lists(sorted(PACKAGE.rglob("*.py")), runs)
    assert not found, "lists of training runs outside their declarations:\n" + "\n".join(found)
    planted = tmp_path / "resident.py"
    planted.write_text('_RUN_DIRS = ("train", "pretrain", "train_document")\nONE = ("train",)\n')
    assert len(_run_lists([planted], runs)) == 1


def test_the_names_of_a_build_under_way_are_spelled_in_one_place():
    """`.NAME.building`, `NAME.partial` and `NAME.tmp-...` are `cfir_jax.stores.atomic_write`'s (`work_dir`,
    `partial_dir`, `temp_name`): no other module writes the suffixes, and none looks for a name nothing makes."""
    spelled = re.compile(r"""["'}]\.(building|partial|tmp)\b""")
    found = [f"{path.relative_to(PACKAGE.parent)}:{n}" for path in sorted(PACKAGE.rglob("*.py"))
             if path.name != "atomic_write.py"
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if spelled.search(line) and not line.lstrip().startswith("#")]
    assert not found, "in-progress suffixes spelled outside atomic_write.py:\n" + "\n".join(found)
