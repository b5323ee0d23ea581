"""The import graph follows the layering of docs/architecture.md, read per file: every `import` of a cfir_jax module
counts, at module level or inside a function (a function-level import is still an arrow), and no group of files
imports itself round."""

import ast
import re
from pathlib import Path

import pytest

import cfir_jax

PACKAGE = Path(cfir_jax.__file__).resolve().parent

# The rooms and their ranks (docs/architecture.md). A file may import files of its own room and of rooms of a lower
# or equal rank; never of a higher one.
RANKS = {
    "core": 0,  # errors, faults, progress, hosts, cli, config
    "stores": 1,  # the store contract, integrity, layout, lock, atomic writes; every store's reader
    "model": 2, "data": 2, "nlp": 2, "search": 2, "eval": 2,
    "builders": 3, "training": 3, "retrieve": 3,  # the three stages: siblings, see WALLS
    "serve": 4, "aot": 4, "rerank": 4, "api": 4,  # api: the library's front door, with the package's own names
    "cluster": 5,  # the service on Ray: the single process's service (serve/) over fronts and index shards
    "commands": 6,
}
# Rooms of one rank that never import each other: the builders, training and retrieval only meet in the stores.
WALLS = {frozenset(("builders", "training")), frozenset(("builders", "retrieve")),
         frozenset(("training", "retrieve"))}


def _room(module: str) -> str:
    parts = module.split(".")
    # `cfir_jax` itself (its __init__: the platform pick, and the library's names, loaded lazily from api/) stands
    # with the front door; nothing in the package imports it.
    return "api" if len(parts) == 1 else parts[1]


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(p for p in parts if p != "__init__")] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module file an imported name lives in: `cfir_jax.stores.layout.Layout` -> `cfir_jax.stores.layout`."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(path: Path) -> set[str]:
    """The cfir_jax modules a file imports, anywhere in it (`from cfir_jax.core import hosts` -> core.hosts)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("cfir_jax"):
            found.update(_resolve(f"{node.module}.{a.name}") for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(_resolve(a.name) for a in node.names if a.name.startswith("cfir_jax"))
    return found - {None}


GRAPH = {module: _imports(path) - {module} for module, path in MODULES.items()}


def test_every_file_is_in_a_room_with_a_rank():
    unknown = sorted(m for m in MODULES if _room(m) not in RANKS)
    assert not unknown, f"files outside the rooms of docs/architecture.md: {unknown}"


def test_no_file_imports_a_higher_room():
    upward = sorted(f"{m} -> {t}" for m, targets in GRAPH.items() for t in targets
                    if RANKS[_room(t)] > RANKS[_room(m)])
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def test_builders_training_and_retrieval_do_not_import_each_other():
    crossing = sorted(f"{m} -> {t}" for m, targets in GRAPH.items() for t in targets
                      if frozenset((_room(m), _room(t))) in WALLS)
    assert not crossing, "\n".join(crossing)


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one file (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_files_import_each_other_round():
    assert not _circles(GRAPH), "import circles:\n" + "\n".join(" <-> ".join(c) for c in _circles(GRAPH))


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set()}, []),
])
def test_the_circle_finder_finds_circles(graph, expected):
    assert _circles(graph) == expected


def test_the_checks_read_function_level_imports():
    """A function-level import is an arrow too: the entity ranking's lazy spaCy import is seen."""
    assert "cfir_jax.nlp.entities" in GRAPH["cfir_jax.retrieve.entity_ranking"]


def test_the_search_layer_stands_on_the_floor_alone():
    """Search sits below the index and retrieval that both use it."""
    bad = sorted(f"{m} -> {t}" for m, targets in GRAPH.items() if _room(m) == "search" for t in targets
                 if _room(t) not in ("core", "stores", "search"))
    assert not bad, "\n".join(bad)


def test_the_index_builder_and_retrieval_share_the_search_layer():
    """One exact top-k, one SR: the entity index's builder and retrieval both import the search layer, and neither
    builders/ nor retrieve/ keeps a scorer of its own (no jitted or numpy top-k outside search/)."""
    builder = ("cfir_jax.builders.entity_index_build", "cfir_jax.builders.candidate_search")  # the build and its search
    assert any(_room(t) == "search" for m in builder for t in GRAPH[m])
    assert any(_room(t) == "search" for m, targets in GRAPH.items() if _room(m) == "retrieve" for t in targets)
    own = [m for m, p in MODULES.items() if _room(m) in ("builders", "retrieve") and "jax.lax.top_k" in p.read_text()]
    assert not own, f"exact top-k outside the search layer: {own}"


def test_stores_hold_no_builder():
    """The stores' readers open finished stores; what writes them in chunks over hosts lives in builders/."""
    builders = sorted(m for m, p in MODULES.items() if _room(m) == "stores" and
                      any(isinstance(n, ast.FunctionDef) and n.name.startswith("build_")
                          for n in ast.parse(p.read_text()).body))
    assert not builders, f"builders among the stores: {builders}"


def test_every_room_is_a_package():
    """setuptools ships only folders with an __init__.py (pyproject.toml's packages.find)."""
    bare = sorted(str(d.relative_to(PACKAGE.parent)) for d in {p.parent for p in PACKAGE.rglob("*.py")}
                  if not (d / "__init__.py").is_file())
    assert not bare, f"folders without an __init__.py: {bare}"


def test_every_store_reader_opens_through_the_store_base():
    """Each reader in stores/ is a `Store`: it says its kind and version, and fills in `check` and `load`; none
    writes its own `open` (the manifest read and its one-line errors are the base's)."""
    readers = []
    for module, path in MODULES.items():
        if _room(module) != "stores":
            continue
        for node in ast.parse(path.read_text()).body:
            methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef)} if isinstance(node, ast.ClassDef) \
                else set()
            if ("load" in methods or "open" in methods) and node.name != "Store":
                readers.append((node.name, [ast.unparse(b) for b in node.bases], "open" in methods))
    assert len(readers) >= 6, readers
    assert all(bases == ["Store"] and not own_open for _, bases, own_open in readers), readers


def _code_strings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every string of a file's code that is one name (no blank: a module, a "module:function", a
    pattern): its docstrings and its messages to the reader (prose, not a reference) left out."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree) if isinstance(node, ast.Constant)
            and isinstance(node.value, str) and id(node) not in docstrings and not re.search(r"\s", node.value)]


# A room named in a string: a module (`cfir_jax.cluster.command`, "cfir_jax/cluster/command.py") or a registry's
# pattern of modules ("builders/*").
_NAMED_ROOM = re.compile(r"\bcfir_jax[./](\w+)|^(\w+)/[\w*]+$")


def _rooms_named_above(graph_modules: dict[str, Path]) -> list[str]:
    out = []
    for module, path in graph_modules.items():
        for line, text in _code_strings(path):
            for found in _NAMED_ROOM.finditer(text):
                room = found.group(1) or found.group(2)
                if room in RANKS and RANKS[room] > RANKS[_room(module)]:
                    out.append(f"{path.name}:{line} {module} names {room}/ in {text!r}")
    return sorted(out)


def test_no_file_names_a_higher_room_by_string():
    """A lower floor reaches what higher rooms declare only through a registry that finds it by a module's name in
    any room (`cfir_jax.core.registry`: "*/directories", "*/serve"): no string of its code (an importlib target, a
    registry's pattern) names a room above its own."""
    found = _rooms_named_above(MODULES)
    assert not found, "strings naming a higher room:\n" + "\n".join(found)


def test_the_string_check_finds_a_table_of_higher_modules(tmp_path):
    """Planted: floor 0 naming an engine's module (the serve.engine table it once held) and a registry's pattern over
    a higher room; a docstring, a message and a wildcard pattern pass."""
    path = tmp_path / "config_check.py"
    path.write_text('"""Mentions cfir_jax.cluster.command in prose."""\n'
                    'HELP = "see cfir_jax/serve/app.py"\n'
                    'ENGINES = {"ray": "cfir_jax.cluster.command:serve_cluster"}\n'
                    'R = Registry("stage", "builders/*")\nS = Registry("engine", "*/serve")\n')
    found = _rooms_named_above({"cfir_jax.core.config_check": path})
    assert [f.split(" names ")[1].split(" ")[0] for f in found] == ["cluster/", "builders/"]


# The one query core (docs/architecture.md): only the library's `Index` makes a Retriever and a `Result` of one.
CORE = "cfir_jax.api.index"
MADE_ONLY_BY_THE_CORE = {("cfir_jax.retrieve.pipeline", "Retriever"): "makes a Retriever",
                         ("cfir_jax.retrieve.results", "Result.of"): "makes a Result (Result.of)"}


def _core_bypasses(module: str, path: Path) -> list[str]:
    """Where a file reaches past the query core: each use of the Retriever class (called, or handed on as a value: a
    `make=Retriever` default is a constructor too; an annotation only names the type) and each `Result.of`, reached
    by any import (`from cfir_jax.retrieve.pipeline import Retriever as R`, `from cfir_jax.retrieve import results`,
    `import cfir_jax.retrieve.results`)."""
    tree = ast.parse(path.read_text())
    names = {}  # local name -> the dotted cfir_jax name it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("cfir_jax"):
            names.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
        elif isinstance(node, ast.Import):  # `import cfir_jax.x.y` binds cfir_jax; `import cfir_jax.x.y as m`, m
            names.update({a.asname or "cfir_jax": a.name if a.asname else "cfir_jax" for a in node.names
                          if a.name.startswith("cfir_jax")})
    annotations = {id(n) for node in ast.walk(tree) for ann in _annotations(node) for n in ast.walk(ann)}

    def dotted(node: ast.expr) -> str | None:
        if isinstance(node, ast.Name):
            return names.get(node.id)
        if isinstance(node, ast.Attribute) and (base := dotted(node.value)) is not None:
            return f"{base}.{node.attr}"
        return None

    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Name, ast.Attribute)) and id(node) not in annotations:
            for (owner, name), what in MADE_ONLY_BY_THE_CORE.items():
                if dotted(node) == f"{owner}.{name}" and module not in (CORE, owner):
                    found.append(f"{path.name}:{node.lineno} {module} {what}")
    return found


def _annotations(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        args = node.args
        every = args.posonlyargs + args.args + args.kwonlyargs + [a for a in (args.vararg, args.kwarg) if a]
        return [a.annotation for a in every if a.annotation is not None] + ([node.returns] if node.returns else [])
    return [node.annotation] if isinstance(node, ast.AnnAssign) else []


def test_only_the_query_core_makes_a_retriever_or_a_result():
    """The commands, the services (the batcher, the image queue, the resident index, the Ray front) and the fits
    reach retrieval through `cfir_jax.api.index.Index`: no other file constructs a Retriever or calls Result.of."""
    found = [line for module, path in MODULES.items() for line in _core_bypasses(module, path)]
    assert not found, "past the one query core:\n" + "\n".join(found)


def test_the_core_check_finds_a_service_that_builds_its_own_retrievers(tmp_path):
    """Planted: the old resident index (`make=Retriever`), a front's own Retriever, the batcher's Result.of under
    each way of importing; an annotation and the core itself pass."""
    path = tmp_path / "resident.py"
    path.write_text("from cfir_jax.retrieve.pipeline import Retriever\nfrom cfir_jax.retrieve import pipeline as p\n"
                    "import cfir_jax.retrieve.results\nfrom cfir_jax.retrieve.results import Result as R\n"
                    "def load(make=Retriever, r: Retriever = None) -> Retriever:\n"
                    "    return p.Retriever(1), R.of(1), cfir_jax.retrieve.results.Result.of(2)\n")
    found = _core_bypasses("cfir_jax.serve.resident", path)
    assert [f.split(" ", 1)[0] for f in found] == ["resident.py:5", "resident.py:6", "resident.py:6", "resident.py:6"]
    assert _core_bypasses(CORE, path) == []


# What starts an operating-system process from Python: the modules that do it, os's calls that do it, and spaCy's own
# multiprocessing (nlp.pipe's `n_process`).
PROCESS_MODULES = ("subprocess", "multiprocessing", "concurrent.futures", "pty")
PROCESS_CALLS = ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "popen", "spawn", "exec")
PROCESS_WORDS = ("n_process", "ProcessPoolExecutor", "Popen")


def _starts_processes(path: Path) -> list[str]:
    """How a file starts processes (`line: what`): an import of a process module, a call of os's process calls, or
    the name of a process-starting argument or class, anywhere in its code."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        hits = [n for n in names if n.split(".")[0] in PROCESS_MODULES or n in PROCESS_MODULES]
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os" and \
                node.attr.startswith(PROCESS_CALLS):
            hits.append(f"os.{node.attr}")
        word = node.arg if isinstance(node, (ast.keyword, ast.arg)) else node.attr if isinstance(node, ast.Attribute) \
            else node.id if isinstance(node, ast.Name) else None
        if word in PROCESS_WORDS:
            hits.append(word)
        found += [f"{node.lineno if hasattr(node, 'lineno') else '?'}: {h}" for h in hits]
    return found


def test_exactly_one_module_of_nlp_starts_processes():
    """spaCy runs in another process one way (`cfir_jax/nlp/entity_workers.py`, docs/architecture.md): the service's,
    bulk retrieval's, index.py's and a query's workers are all its pools, and no other module of nlp/ starts one."""
    starters = {path.name: hits for path in sorted((PACKAGE / "nlp").glob("*.py")) if (hits := _starts_processes(path))}
    assert list(starters) == ["entity_workers.py"], starters


def test_the_process_check_finds_each_way_to_start_one(tmp_path):
    """Planted: spaCy's own workers, a pool, a Popen, a fork; a file that only runs threads passes."""
    ways = {"spacy": "docs = nlp.pipe(texts, n_process=2)\n", "pool": "import multiprocessing\n",
            "futures": "from concurrent.futures import ProcessPoolExecutor\n",
            "popen": "from subprocess import Popen\n", "fork": "import os\npid = os.fork()\n",
            "threads": "import threading\nthreading.Thread(target=print).start()\n"}
    found = {}
    for name, code in ways.items():
        (tmp_path / f"{name}.py").write_text(code)
        found[name] = bool(_starts_processes(tmp_path / f"{name}.py"))
    assert found == {**{name: True for name in ways}, "threads": False}


# HTTP once (docs/architecture.md): the service raises the project's errors (`cfir_jax.serve.errors`), and one module
# of serve/, the app, answers them over HTTP; no other module of serve/ names an HTTP exception.
HTTP_EXCEPTIONS = ("HTTPException",)


def _names_http_exceptions(path: Path) -> list[str]:
    """Each place a file names an HTTP exception class: imported, raised, caught or referred to by attribute."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) \
            else node.name if isinstance(node, ast.alias) else None
        if name in HTTP_EXCEPTIONS:
            found.append(f"{getattr(node, 'lineno', '?')}: {name}")
    return found


def test_at_most_one_module_of_serve_names_http_exceptions():
    """The Service, the image queue and the request guard raise `cfir_jax.serve.errors`' errors; the app answers
    them through that module's one table, as the Ray gateway does."""
    naming = {path.name: hits for path in sorted((PACKAGE / "serve").glob("*.py"))
              if (hits := _names_http_exceptions(path))}
    assert len(naming) <= 1, f"serve/ modules naming an HTTP exception (at most one may): {naming}"


def test_the_http_check_finds_each_way_to_name_one(tmp_path):
    """Planted: an import, a raise through a module's attribute, a catch; a file that raises the project's passes."""
    ways = {"imported": "from starlette.exceptions import HTTPException\n",
            "attribute": "import starlette.exceptions as x\nraise x.HTTPException(503)\n",
            "caught": "try:\n    pass\nexcept HTTPException:\n    pass\n",
            "ours": "from cfir_jax.serve.errors import Refused\nraise Refused('no', 422)\n"}
    found = {}
    for name, code in ways.items():
        (tmp_path / f"{name}.py").write_text(code)
        found[name] = bool(_names_http_exceptions(tmp_path / f"{name}.py"))
    assert found == {**{name: True for name in ways}, "ours": False}



# The core's door (docs/architecture.md): only api/ (the `Index` that holds the Retrievers) and retrieve/ (the
# pipeline itself) reach a Retriever; everyone else asks `Index` with its own verbs.
DOOR_ROOMS = ("api", "retrieve")


def _reaches_the_retriever(path: Path) -> list[str]:
    """Each call of a `.retriever(...)` (or `._retriever(...)`) method in a file."""
    return [f"{path.name}:{node.lineno} .{node.func.attr}(" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("retriever", "_retriever")]


def test_no_retriever_is_reached_outside_api_and_retrieve():
    """The services, the fits and evaluation use `Index`'s verbs (warm up, scoring, notes, the corpus's documents, the
    re-ranker's features), never the Retriever under it."""
    found = [hit for module, path in MODULES.items() if _room(module) not in DOOR_ROOMS
             for hit in _reaches_the_retriever(path)]
    assert not found, "past the core's door:\n" + "\n".join(found)


def test_the_door_check_finds_a_reach_through_index(tmp_path):
    path = tmp_path / "evaluate.py"
    path.write_text("r = index.retriever()\ns = Index(c, w)._retriever('bm25').sr\nretriever = index.notes\n")
    assert [f.split(" ")[0] for f in _reaches_the_retriever(path)] == ["evaluate.py:1", "evaluate.py:2"]
