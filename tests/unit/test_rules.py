"""The rules docs/architecture.md and the style guide state, each a test that can fail: functions at most 60 lines
unless marked as one recipe, a `# why:` above every function-level import, modules at most 400 lines, every path,
dotted module and config key in a docs code span real, a unit-test folder for every room that holds logic, and the
docs' rank table equal to the test's RANKS."""

from pathlib import Path

import pytest
import rules
from test_architecture import RANKS

from cfir_jax.core.cli import load_config_file
from cfir_jax.core.config import defaults

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
PACKAGE = ROOT / "cfir_jax"
# The code the rules hold: the package, the three scripts and the configs.
SOURCES = sorted([*PACKAGE.rglob("*.py"), ROOT / "index.py", ROOT / "train.py", ROOT / "retrieve.py",
                  *(ROOT / "configs").glob("*.py")])
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Every config file, with the variants that add keys (the demo's caption pretraining).
CONFIG_FILES = ("configs/base.py", "configs/large.py", "configs/collection.py", "configs/demo.py:tiny,full")


def _findings(check) -> list[str]:
    return [f for path in SOURCES for f in check(path, ROOT)]


def _fail_message(rule: str, found: list[str]) -> str:
    return f"{len(found)} {rule}:\n" + "\n".join(found)


def test_functions_are_at_most_60_lines_unless_one_recipe():
    """A longer function is one recipe read top to bottom, and a `# recipe:` comment above it says so."""
    found = _findings(rules.function_lengths)
    assert not found, _fail_message("functions over 60 lines without a `# recipe:` comment", found)


def test_every_function_level_import_says_why():
    """An import inside a function keeps a heavy dependency off a light path and names it in a `# why:` comment above
    its block; any other import belongs at the top of its file."""
    found = _findings(rules.silent_imports)
    assert not found, _fail_message("function-level imports without a `# why:` comment", found)


def test_modules_are_at_most_400_lines_unless_their_docstring_says_why():
    """A cohesive module may pass 400 lines where its docstring says why (never 600): the limit finds smells; it is
    not a reason to split one concept in two."""
    found = _findings(rules.module_length)
    assert not found, _fail_message("modules over 400 lines", found)


def test_the_module_length_check_reads_the_docstrings_reason(tmp_path):
    body = "\n".join(f"x{n} = {n}" for n in range(450))
    said = '"""One concept, over 400 lines because it is one."""'
    for docstring, found in (('"""A module."""', True), (said, False)):
        (tmp_path / "m.py").write_text(f"{docstring}\n{body}\n")
        assert bool(rules.module_length(tmp_path / "m.py", tmp_path)) is found
    (tmp_path / "m.py").write_text('"""Over 400 lines because it is one."""\n' + "\n".join(["y = 1"] * 650))
    assert rules.module_length(tmp_path / "m.py", tmp_path)  # never past 600


@pytest.mark.parametrize("script", ["index.py", "train.py", "retrieve.py"])
def test_the_scripts_only_parse_flags_and_dispatch(script):
    """A script is at most 80 lines: its docstring, its flags (`cfir_jax.commands.flags`), one `run` per mode."""
    n = len((ROOT / script).read_text().splitlines())
    assert n <= 80, f"{script} has {n} lines: move its checks and bodies to cfir_jax/commands/"


def _config_keys() -> set[str]:
    """Every key of the config tree (`a.b.c`), of the defaults and of each config file's variants."""
    def keys(node, prefix=""):
        out = set()
        for key, value in node.items():
            out.add(prefix + key)
            if hasattr(value, "items"):
                out |= keys(value, f"{prefix}{key}.")
        return out
    configs = [load_config_file(str(ROOT / spec)) for spec in CONFIG_FILES]
    return keys(defaults("base")).union(*(keys(cfg) for cfg in configs))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_module_and_config_key_in_the_docs_exists(doc):
    rooms = [p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()]
    found = rules.stale_references(doc, ROOT, rooms=rooms, config_keys=_config_keys())
    assert not found, "stale code spans:\n" + "\n".join(found)


def test_the_docs_checker_finds_stale_names(tmp_path):
    """Planted: a missing test file, a module that moved, a definition that is gone, an old module name, a config
    key that is not one; a command, a workdir path, another project's file and a real config key pass."""
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "tests").mkdir()
    pkg = tmp_path / "cfir_jax" / "stores"
    pkg.mkdir(parents=True)
    (tmp_path / "cfir_jax" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "contract.py").write_text("def atomic_dir():\n    pass\n")
    doc = tmp_path / "page.md"
    doc.write_text("`tests/test_gone.py` `stores.entity_pool` `cfir_jax.stores.contract.atomic_file` "
                   "`store.atomic_dir` `serve.workers`\n"
                   "`python index.py --add new/` `W/model` `beit3/datasets.py:12` `serve.port` "
                   "`cfir_jax.stores.contract.atomic_dir` `stores/contract.py:atomic_dir`\n")
    found = rules.stale_references(doc, tmp_path, rooms=["stores"], config_keys={"serve", "serve.port"})
    assert [f.split("`")[1] for f in found] == ["tests/test_gone.py", "stores.entity_pool",
                                                 "cfir_jax.stores.contract.atomic_file", "store.atomic_dir",
                                                 "serve.workers"]


def test_the_code_checkers_find_what_they_hold(tmp_path):
    """Planted: a 61-line function, the same marked as one recipe, silent and explained function-level imports."""
    body = "".join(f"    x{i} = {i}\n" for i in range(60))
    path = tmp_path / "m.py"
    path.write_text(f"def long():\n{body}\n\n# recipe: one literal\ndef marked():\n{body}\n\n"
                    "def lazy():\n    import json\n\n    # why: numpy stays off the light path\n    import numpy\n\n"
                    "    from pathlib import Path\n    return json, numpy, Path\n")
    assert rules.function_lengths(path, tmp_path) == ["m.py:1 long has 61 lines"]
    assert rules.silent_imports(path, tmp_path) == ["m.py:129 import json"]
    assert rules.module_length(path, tmp_path) == []


def test_no_public_function_takes_more_than_8_parameters():
    """Long parameter lists become the values they are (issue 58): the `Query` at the search doors, a small frozen
    settings dataclass for a builder or a command's options."""
    found = [f for path in sorted(PACKAGE.rglob("*.py")) for f in rules.long_parameter_lists(path, ROOT)]
    assert not found, _fail_message("public functions over 8 parameters", found)


def test_the_parameter_check_counts_what_a_caller_passes(tmp_path):
    """Planted: 9 parameters (a *args and a **kwargs among them) fail, in a function and a method; self, a private
    function, a private class's method and a nested function do not count."""
    nine = "a, b, c, d, e, f, g, *args, **kwargs"
    path = tmp_path / "m.py"
    path.write_text(f"def wide({nine}):\n    def inner({nine}):\n        pass\n\n\n"
                    f"def _private({nine}):\n    pass\n\n\n"
                    f"class A:\n    def method(self, a, b, c, d, e, f, g, h):\n        pass\n\n"
                    f"    def wider(self, {nine}):\n        pass\n\n\n"
                    f"class _B:\n    def method(self, {nine}):\n        pass\n")
    assert rules.long_parameter_lists(path, tmp_path) == ["m.py:1 wide takes 9 parameters",
                                                          "m.py:14 wider takes 9 parameters"]


def test_no_module_cuts_a_message_to_its_first_line_by_hand():
    """One helper says an error in one line, `cfir_jax.core.errors.first_line` (limit included): it also answers
    for an empty message, where a hand-written `str(e).splitlines()[0]` raises IndexError."""
    found = [f for path in sorted(PACKAGE.rglob("*.py")) for f in rules.hand_cut_messages(path, ROOT)]
    assert not found, _fail_message("hand-written `str(...).splitlines()[0]` (use core.errors.first_line)", found)


def test_the_message_check_finds_a_hand_cut_line(tmp_path):
    """Planted: str(e)'s first line, through .strip() and `or`, is found; a docstring's or a text's first line is
    not an error's message."""
    path = tmp_path / "m.py"
    path.write_text("def f(e, text):\n    a = str(e).splitlines()[0][:80]\n"
                    "    b = (str(e) or type(e).__name__).strip().splitlines()[0]\n"
                    "    return a, b, f.__doc__.splitlines()[0], text.splitlines()[0]\n")
    assert rules.hand_cut_messages(path, tmp_path) == ["m.py:2 str(e).splitlines()[0]",
                                                       "m.py:3 (str(e) or type(e).__name__).strip().splitlines()[0]"]


def _rooms_with_logic() -> list[str]:
    return sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()
                  and any(m.name != "__init__.py" for m in p.glob("*.py")))


@pytest.mark.parametrize("room", _rooms_with_logic())
def test_every_room_with_logic_has_unit_tests(room):
    """Tests mirror the rooms: tests/unit/<room>/ holds tests of that room."""
    tests = list((ROOT / "tests" / "unit" / room).glob("test_*.py"))
    assert tests, f"tests/unit/{room}/ has no test module"


def test_the_docs_rank_table_is_the_tests_ranks():
    assert rules.rank_table(ROOT / "docs" / "architecture.md") == RANKS
