"""The checks behind tests/unit/test_rules.py, over the repository's text alone (no cfir_jax import): each returns its
findings as 'PATH:LINE what' lines, so a test can report them, and a planted example can prove that it finds one."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 400
# A module may pass MAX_MODULE_LINES when it is one concept that splitting would break, and its docstring says why in
# a sentence holding LONG_REASON; never past MAX_LONG_MODULE_LINES.
LONG_REASON = "over 400 lines because"
MAX_LONG_MODULE_LINES = 600
RECIPE = "# recipe:"
WHY = "# why:"


def function_lengths(path: Path, root: Path) -> list[str]:
    """Functions over MAX_FUNCTION_LINES lines (decorators included) without a `# recipe:` comment right above."""
    lines = path.read_text().splitlines()
    out = []
    for fn in ast.walk(ast.parse("\n".join(lines))):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        start = min([fn.lineno] + [d.lineno for d in fn.decorator_list])
        length = fn.end_lineno - start + 1
        if length > MAX_FUNCTION_LINES and not _comment_above(lines, start, RECIPE):
            out.append(f"{path.relative_to(root)}:{fn.lineno} {fn.name} has {length} lines")
    return out


def _comment_above(lines: list[str], lineno: int, marker: str) -> bool:
    """Whether the comment block right above line `lineno` (1-based) holds `marker` at the start of one of its
    lines."""
    i = lineno - 2
    while i >= 0 and lines[i].lstrip().startswith("#"):
        if lines[i].lstrip().startswith(marker):
            return True
        i -= 1
    return False


def silent_imports(path: Path, root: Path) -> list[str]:
    """Imports inside a function without a `# why:` comment above their block (a run of import lines, blank lines
    between the groups allowed)."""
    lines = path.read_text().splitlines()
    out = []
    for fn in ast.walk(ast.parse("\n".join(lines))):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.iter_child_nodes(fn) if False else _own_statements(fn):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            i = node.lineno - 1
            while i > 0 and (lines[i - 1].lstrip().startswith(("from ", "import ")) or not lines[i - 1].strip()
                             or lines[i - 1].startswith((" ", "\t")) and lines[i - 1].strip().startswith(")")):
                i -= 1
            if not (i > 0 and lines[i - 1].lstrip().startswith(WHY)):
                out.append(f"{path.relative_to(root)}:{node.lineno} {ast.unparse(node)}")
    return sorted(set(out))


def _own_statements(fn: ast.AST):
    """Every statement inside `fn`, nested functions' included (each import is found once, by ast.walk)."""
    return (n for n in ast.walk(fn) if n is not fn)


def module_length(path: Path, root: Path) -> list[str]:
    """Modules over MAX_MODULE_LINES lines whose docstring does not say why (LONG_REASON), and any module over
    MAX_LONG_MODULE_LINES."""
    text = path.read_text()
    n = len(text.splitlines())
    if n <= MAX_MODULE_LINES:
        return []
    try:
        said = LONG_REASON in " ".join((ast.get_docstring(ast.parse(text)) or "").split())
    except SyntaxError:
        said = False
    if said and n <= MAX_LONG_MODULE_LINES:
        return []
    why = f"over {MAX_LONG_MODULE_LINES}" if said else f"its docstring does not say why ('{LONG_REASON} ...')"
    return [f"{path.relative_to(root)} has {n} lines: {why}"]


MAX_PARAMETERS = 8


def long_parameter_lists(path: Path, root: Path) -> list[str]:
    """Public functions and methods over MAX_PARAMETERS parameters (self and cls not counted; *args and **kwargs one
    each): a long list is a value that wants its name (a settings dataclass, the `Query`)."""
    out = []

    def visit(node: ast.AST, private: bool, in_class: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, private or child.name.startswith("_"), True)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = child.args
                names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
                static = any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in child.decorator_list)
                if in_class and not static and names[:1] in (["self"], ["cls"]):
                    names = names[1:]
                n = len(names) + (a.vararg is not None) + (a.kwarg is not None)
                if n > MAX_PARAMETERS and not private and not child.name.startswith("_"):
                    out.append(f"{path.relative_to(root)}:{child.lineno} {child.name} takes {n} parameters")
                visit(child, True, False)  # a nested function is no one's API
            else:
                visit(child, private, in_class)

    visit(ast.parse(path.read_text()), False, False)
    return out


def hand_cut_messages(path: Path, root: Path) -> list[str]:
    """`str(...).splitlines()[0]` written by hand (through any `.strip()`, `or` or parentheses): an error's message
    is cut to one line by `cfir_jax.core.errors.first_line` alone, which also says something when it is empty."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == 0
                and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute)
                and node.value.func.attr == "splitlines"):
            continue
        receiver = node.value.func.value
        if any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "str"
               for n in ast.walk(receiver)):
            out.append((node.lineno, f"{path.relative_to(root)}:{node.lineno} {ast.unparse(node)}"))
    return [line for _, line in sorted(out)]


_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
_CODE_SPAN = re.compile(r"`([^`\n]+)`")
# A repository path: folders and a file with a known extension, optionally `:name` (a definition in it) or
# `:variant` (a config's); or a folder ending in '/'.
_PATH = re.compile(r"^(?P<path>[\w.-]+(?:/[\w.-]+)*\.(?:py|md|json|toml|sh|txt|yaml|yml|cfg))(?::(?P<name>[\w,.=]+))?$")
_FOLDER = re.compile(r"^(?P<path>(?:[\w.-]+/)+)$")
_DOTTED = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+$")
# Where a written path may be relative to: the repository root, the package (rooms: `training/loop.py`), tests/.
_BASES = ("", "cfir_jax/", "tests/")


def code_spans(text: str) -> list[tuple[int, str]]:
    """(line, content) of every code span outside fenced blocks."""
    out = []
    blanked = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for i, line in enumerate(blanked.splitlines(), 1):
        out += [(i, m.group(1).strip()) for m in _CODE_SPAN.finditer(line)]
    return out


def stale_references(doc: Path, root: Path, rooms=(), config_keys=frozenset(), package: str = "cfir_jax"
                     ) -> list[str]:
    """The code spans of `doc` that name a file of the repository, a dotted module (and a definition in it) of
    `package` or of one of its `rooms`, or a config key, that does not exist. A span is read whole: `index.py --add`
    is a command, not a path; names of other projects' files (`beit3/datasets.py:12`) and of a workdir's (`W/model`,
    `index.json`) are not the repository's."""
    out = []
    defined = _package_definitions(root / package)
    for line, span in code_spans(doc.read_text()):
        problems = [_check_span(span, root, package, tuple(rooms), config_keys, defined)]
        # Inside a longer span (a command, a call): every `cfir_jax.x.y` and every path of the repository's folders.
        problems += [_check_span(token, root, package, tuple(rooms), config_keys, defined)
                     for token in _TOKEN.findall(span) if token != span and
                     (token.startswith(package + ".") or "/" in token)]
        out += [f"{doc.relative_to(root)}:{line} `{span}` {p}" for p in dict.fromkeys(problems) if p]
    return out


_TOKEN = re.compile(r"[\w./:-]+")


@dataclasses.dataclass
class _Package:
    """What a short dotted name in prose may stand for: `module.name` (a module of the package by its file name),
    `Class.member`, or another project's `jax.jit` (a name the package imports)."""

    definitions: set[str]  # top-level functions and classes of every module
    modules: dict[str, list[Path]]  # file name -> the modules of that name
    imported: set[str]  # the names the package's modules import (jax, np, nnx, ...)


def _package_definitions(package_dir: Path) -> _Package:
    out = _Package(set(), {}, set())
    for path in package_dir.rglob("*.py"):
        tree = ast.parse(path.read_text())
        out.definitions |= {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        out.modules.setdefault(path.stem, []).append(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                out.imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not (node.module or "").startswith("cfir_jax"):
                out.imported |= {a.asname or a.name for a in node.names}
    return out


# spaCy's `nlp.pipe`: a dotted name of another project that starts like a room.
EXTERNAL = frozenset({"nlp.pipe"})
# `beit3.spm`, `ids.txt`: a file a user brings, not a dotted name.
DATA_FILES = frozenset({"spm", "npy", "npz", "parquet", "jsonl", "json", "txt", "trec", "png", "jpg", "gif", "pth",
                        "html", "tsv", "csv"})


def _check_span(span: str, root: Path, package: str, rooms: tuple, config_keys, defined: _Package | None = None
                ) -> str | None:
    if span.startswith(("W/", "/", "~", "$", "http", "..", "./")) or "*" in span or "<" in span:
        return None
    m = _PATH.match(span) or _FOLDER.match(span)
    if m:
        return _check_path(m.group("path").rstrip("/"), m.groupdict().get("name"), root, package, rooms)
    if not _DOTTED.match(span) or span in EXTERNAL or span.rpartition(".")[2] in DATA_FILES:
        return None
    first = span.split(".")[0]
    if any(key == span or key.startswith(span + ".") for key in config_keys):
        return None
    if first == package or first in rooms:
        return _check_dotted(span if first == package else f"{package}.{span}", root)
    if any(key.split(".")[0] == first for key in config_keys):
        return "names no config key (cfir_jax/core/config.py, configs/*.py)"
    return _check_short_name(span, package, defined) if defined is not None and span.count(".") == 1 else None


def _check_path(path: str, name: str | None, root: Path, package: str, rooms) -> str | None:
    """A path of the repository (or of a room, `training/loop.py`), and the definition after its colon."""
    first = path.split("/")[0]
    ours = "/" in path and ((root / first).exists() or first in rooms)
    base = next((b for b in ("", package + "/") if (root / b / path).exists()), None)
    if base is None:
        return "names no file of the repository" if ours else None
    target = root / base / path
    if name and not name.isdigit() and target.suffix == ".py" and not path.startswith("configs/") and \
            not _defines(target, name):
        return f"names {name}, which {base}{path} does not define"
    return None


def _check_short_name(span: str, package: str, defined: _Package) -> str | None:
    """`module.name` in prose: `integrity.verify_workdir` must be defined by a module of that file name, and
    `store.atomic_dir` (a definition under a module the package does not have) is stale."""
    first, name = span.split(".")
    if first in defined.imported or first in defined.definitions:  # `jax.jit`, `Class.member`
        return None
    if first in defined.modules:
        if not any(_defines(m, name) for m in defined.modules[first]):
            return f"names {name}, which no module {first}.py defines"
    elif name in defined.definitions:
        return f"names {name} under a module {first} that {package} does not have"
    return None


def _check_dotted(dotted: str, root: Path) -> str | None:
    """`cfir_jax.a.b.name`: the longest prefix that is a module or package, then names it defines."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        base = root.joinpath(*parts[:n])
        module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if module.is_file():
            rest = parts[n:]
            if not rest or _defines(module, rest[0]) or (module.name == "__init__.py" and not rest[1:] and
                                                          (base / rest[0]).is_dir()):
                return None
            return f"names {'.'.join(rest)}, which {module.relative_to(root)} does not define"
    return "names no module of the package"


def _defines(module: Path, name: str) -> bool:
    """Whether `module` defines `name` at its top level or as a member of one of its classes (or imports it, or
    declares it in `__all__`: a package's lazily loaded names)."""
    tree = ast.parse(module.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and \
                    isinstance(node.value, (ast.List, ast.Tuple)):  # the names a lazy module declares (PEP 562)
                names |= {e.value for e in node.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
            names |= {t.attr for t in targets if isinstance(t, ast.Attribute)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return name.split(".")[0] in names


def rank_table(architecture_md: Path) -> dict[str, int]:
    """The rooms and ranks of the architecture page's table: '| 0 | `core/` | ...' -> {'core': 0}."""
    out = {}
    for rank, room in re.findall(r"^\|\s*(\d+)\s*\|\s*`(\w+)/`\s*\|", architecture_md.read_text(), re.M):
        out[room] = int(rank)
    return out
