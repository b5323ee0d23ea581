"""The query's trip through the modules, traced statically: `asked` of `retrieve.py --query`'s `run`
(`commands/retrieve.py`), through the door, `Index`, the pipeline (the filter, the language, ER, the methods' ranking,
the third stage, folding) and back to the report, held to at most MAX_STAYS module stays and MAX_RETURNS returns to
a module already left (docs/architecture.md, "The one query core").

How the trace is made (read from the source with `ast`, nothing is imported or run):
- It follows the query's value, not every call: it starts in `cfir_jax/commands/retrieve.py` at `run` with its
  parameter `asked`, and in each function it reaches it knows which names hold the query or what was made from it
  (the parameters handed it, and every name bound to an expression that mentions one: assignments, loop and
  comprehension targets, `with ... as`; a lambda handed to a call beside the query gets it in its parameters), every
  branch included (a static trace cannot know the flags). A call that the query goes into (an argument or the
  receiver mentions such a name) is followed, into the parameters it fills; other calls (opening the stores, the
  models, warm-ups) are not the query's trip.
- A call is followed when it resolves to a function of `cfir_jax`: a name the module defines or imports
  (`from cfir_jax.x import f`), an attribute of an imported module (`report.table`), `self.method` inside a class,
  a method of an attribute of `self` whose class the class's `__init__` says (`self.part = C(...)`, or `C(...) if
  ... else None`, or the return of a call annotated with the class, or `self.part: C`), or a method of a variable
  whose class the function knows: made by calling the class (`index = Index(...)`, `with C(...) as c`), returned by
  a call annotated with the class (`-> Retriever`), or a parameter annotated with it. Calling a class is a call of
  its `__init__`; a class without one (a record) runs no code of its module. Builtins, third-party calls and calls
  the source does not resolve (a method of a call's value, a callback's own body, an attribute made by calling a
  parameter: the Retriever's `scoring`, SR's front end) are not followed.
- Each call into another module appends the callee's module to the trip, whether or not that function's body was
  walked before (control goes there again); a body is walked once for each set of parameters holding the query. A
  call inside the caller's own module is part of its stay. Coming back from a call appends nothing: the trip lists
  where calls go, so a module that is called again after the query has been elsewhere counts as a return.
- The floors (rooms of rank 2 or lower: `core/`, `stores/`, `model/`, `data/`, `nlp/`, `search/`, `eval/`) are one
  stay each and not entered: by the import rule they cannot call back up. Every other module is entered, the
  pipeline (`retrieve/pipeline.py`) included.
- A stay is a maximal run of one module in the trip; a return is a stay in a module the trip had already left.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import cfir_jax

PACKAGE = Path(cfir_jax.__file__).resolve().parent
FLOOR_ROOMS = {"core", "stores", "model", "data", "nlp", "search", "eval"}  # rank <= 2 (docs/architecture.md)
PIPELINE = "cfir_jax.retrieve.pipeline"
# The trip as the code stands: a ceiling that holds it there, not the goal. Issue 58 asks for 10 stays and 2 returns;
# before the pipeline the query makes 6 stays and no return, and from the pipeline on 45: its stages live in 8 modules
# of retrieve/ that it calls in turn for each batch (the filter, the language, ER, the methods, BM25, the third stage
# and its two), each with its floors, and folding's refill runs it again. 49 and 21 until the service's entity pool
# became the Retriever's (issue 60): the trip now also goes to the pool's module (`nlp/entity_workers.py`) and back
# from ER, where the call was untyped before. A trip has at least as many stays as the modules it reaches, and it
# reaches 29 (`test_the_trip_reaches_each_concern_of_the_query_once_by_module`), each one concern (the query file,
# its conditions, the live rows, the language, spaCy's pool, BM25, ScaNN, top-k, the text encoder, the re-ranker,
# the records, the report, the run file, ...): 10 stays would need them merged into 10 modules, against the issue's
# own "sizes by cohesion".
MAX_STAYS, MAX_RETURNS = 51, 22


@dataclasses.dataclass
class _Module:
    name: str
    functions: dict[str, ast.FunctionDef]  # "f" and "Class.method"
    classes: set[str]
    imports: dict[str, tuple[str, str | None]]  # local name -> (module, attribute or None for the module itself)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(p for p in parts if p != "__init__")


def _parse(path: Path) -> _Module:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    name = _module_name(path)
    functions, classes, imports = {}, set(), {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions[node.name] = node
        elif isinstance(node, ast.ClassDef):
            classes.add(node.name)
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    functions[f"{node.name}.{item.name}"] = item
    for node in ast.walk(tree):  # function-level imports too: they bind names where they stand
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("cfir_jax"):
            for alias in node.names:
                imports[alias.asname or alias.name] = (node.module, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("cfir_jax"):
                    imports[alias.asname or alias.name.split(".")[0]] = (alias.name, None)
    return _Module(name, functions, classes, imports)


MODULES = {m.name: m for m in map(_parse, PACKAGE.rglob("*.py"))}


def _target(module: str, name: str) -> tuple[str, str] | None:
    """(module, "f" | "Class") of `name` imported from `module`, or of the submodule `module.name`'s module."""
    if module in MODULES and (name in MODULES[module].functions or name in MODULES[module].classes):
        return module, name
    return None


class _Tracer:
    def __init__(self):
        self.trip: list[str] = []
        self.walked: set[tuple[str, str, frozenset[str]]] = set()

    def resolve_name(self, mod: _Module, name: str) -> tuple[str, str] | None:
        if name in mod.functions or name in mod.classes:
            return mod.name, name
        if name in mod.imports:
            source, attr = mod.imports[name]
            if attr is not None:
                return _target(source, attr)
        return None

    def module_of(self, mod: _Module, name: str) -> str | None:
        """The cfir_jax module a local name stands for (`from cfir_jax.retrieve import report` -> its module)."""
        if name in mod.imports:
            source, attr = mod.imports[name]
            full = source if attr is None else f"{source}.{attr}"
            return full if full in MODULES else None
        return None

    def class_of_annotation(self, mod: _Module, annotation: ast.expr | None) -> tuple[str, str] | None:
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
            annotation = ast.parse(annotation.value, mode="eval").body
        if isinstance(annotation, ast.Name):
            found = self.resolve_name(mod, annotation.id)
            if found and found[1] in MODULES[found[0]].classes:
                return found
        return None

    def resolve(self, mod: _Module, cls: str | None, call: ast.Call, types: dict) -> tuple[str, str] | None:
        """(module, qualified function or class) a call goes to, when the source says."""
        f = call.func
        if isinstance(f, ast.Name):
            return self.resolve_name(mod, f.id)
        if isinstance(f, ast.Attribute) and _is_self_attribute(f.value) and cls is not None:
            owned = self.attribute_class(mod, cls, f.value.attr)  # `self.part.method(...)`: the part's class
            if owned is not None and f"{owned[1]}.{f.attr}" in MODULES[owned[0]].functions:
                return owned[0], f"{owned[1]}.{f.attr}"
            return None
        if not isinstance(f, ast.Attribute) or not isinstance(f.value, ast.Name):
            return None
        base, attr = f.value.id, f.attr
        if base == "self" and cls is not None and f"{cls}.{attr}" in mod.functions:
            return mod.name, f"{cls}.{attr}"
        if base in types:
            owner, klass = types[base]
            if f"{klass}.{attr}" in MODULES[owner].functions:
                return owner, f"{klass}.{attr}"
            return None
        if (klass := self.resolve_name(mod, base)) is not None and f"{klass[1]}.{attr}" in MODULES[klass[0]].functions:
            return klass[0], f"{klass[1]}.{attr}"  # a class's own method (`Result.of`)
        target = self.module_of(mod, base)
        if target is not None:
            return _target(target, attr)
        return None

    def attribute_class(self, mod: _Module, cls: str, attr: str) -> tuple[str, str] | None:
        """The class of `self.attr` in a method of `cls`: what its `__init__` binds it to (`self.attr = C(...)`, or the
        return of a call annotated with a class), or its annotation there (`self.attr: C = ...`)."""
        init = mod.functions.get(f"{cls}.__init__")
        if init is None:
            return None
        types = {}
        for node in ast.walk(init):
            if isinstance(node, ast.AnnAssign) and _is_self_attribute(node.target) and node.target.attr == attr:
                return self.class_of_annotation(mod, node.annotation)
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and _is_self_attribute(node.targets[0]) \
                    and node.targets[0].attr == attr:
                value = node.value.body if isinstance(node.value, ast.IfExp) else node.value  # `C(...) if x else None`
                if isinstance(value, ast.Call) and (target := self.resolve(mod, None, value, types)) is not None:
                    return self.returned_class(target)
        return None

    def returned_class(self, target: tuple[str, str]) -> tuple[str, str] | None:
        owner, name = target
        if name in MODULES[owner].classes:
            return target
        fn = MODULES[owner].functions.get(name)
        return self.class_of_annotation(MODULES[owner], fn.returns) if fn is not None else None

    def walk(self, module: str, qualname: str, carried: frozenset[str]) -> None:
        """The calls of one function that carry the query: `carried` names its parameters holding it ("self" when its
        receiver does)."""
        if (module, qualname, carried) in self.walked:
            return
        self.walked.add((module, qualname, carried))
        mod, fn = MODULES[module], MODULES[module].functions[qualname]
        cls = qualname.split(".")[0] if "." in qualname else None
        types = {}  # local name -> (module, class)
        for arg in fn.args.args + fn.args.kwonlyargs:
            if (found := self.class_of_annotation(mod, arg.annotation)) is not None:
                types[arg.arg] = found
        holding = _holding(fn, carried)
        calls = sorted((n for n in ast.walk(fn) if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset))
        bound = _bindings(fn)
        for call in calls:
            target = self.resolve(mod, cls, call, types)
            if target is None:
                continue
            if (name := bound.get(id(call))) is not None and (klass := self.returned_class(target)) is not None:
                types[name] = klass
            if _carries(call, holding):
                self.enter(*target, caller=module, call=call, holding=holding)

    def enter(self, module: str, name: str, caller: str, call: ast.Call, holding: set[str]) -> None:
        qualname = f"{name}.__init__" if name in MODULES[module].classes else name
        if qualname not in MODULES[module].functions:
            return  # a record: no code of its module runs
        if module != caller:  # a call inside the module is part of its stay
            self.trip.append(module)
        room = module.split(".")[1] if "." in module else "api"
        if room in FLOOR_ROOMS:
            return
        self.walk(module, qualname, _parameters_given(MODULES[module].functions[qualname], "." in qualname, call,
                                                       holding))


def _mentions(node: ast.AST, holding: set[str]) -> bool:
    return any(isinstance(n, ast.Name) and n.id in holding for n in ast.walk(node))


def _names(target: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def _arguments(call: ast.Call) -> list[ast.expr]:
    return [*call.args, *(k.value for k in call.keywords)]


def _carries(call: ast.Call, holding: set[str]) -> bool:
    """Whether the query goes into the call: an argument or the receiver (`x.f(...)`) holds it."""
    receiver = call.func.value if isinstance(call.func, ast.Attribute) else None
    return any(_mentions(a, holding) for a in _arguments(call)) or (receiver is not None
                                                                   and _mentions(receiver, holding))


def _holding(fn: ast.FunctionDef, carried: frozenset[str]) -> set[str]:
    """The names of `fn` that hold the query (or what was made from it), every branch included: the parameters that
    carry it, and whatever is bound to an expression that mentions one (an assignment, a loop's or a
    comprehension's target, `with ... as`), to a fixed point. A callback handed to a call with the query (a lambda
    beside it) gets it: its parameters hold it. `self` holding it: the receiver was made from the query."""
    holding = set(carried)
    while True:
        before = len(holding)
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and _mentions(node.value, holding):
                holding |= set().union(*map(_names, node.targets))
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) and node.value is not None \
                    and _mentions(node.value, holding):
                holding |= _names(node.target)
            elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)) and _mentions(node.iter, holding):
                holding |= _names(node.target)
            elif isinstance(node, ast.withitem) and node.optional_vars is not None \
                    and _mentions(node.context_expr, holding):
                holding |= _names(node.optional_vars)
            elif isinstance(node, ast.Call) and _carries(node, holding):
                for given in _arguments(node):
                    if isinstance(given, ast.Lambda):
                        holding |= {p.arg for p in given.args.args}
        if len(holding) == before:
            return holding


def _parameters_given(fn: ast.FunctionDef, method: bool, call: ast.Call, holding: set[str]) -> frozenset[str]:
    """The parameters of `fn` that the call hands the query: by position, by keyword, into *args or **kwargs, and a
    method's `self` when the receiver holds it (a class called: its `__init__`, `self` the new object)."""
    params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
    given = set()
    if method and params:
        receiver = call.func.value if isinstance(call.func, ast.Attribute) else None
        if fn.name != "__init__" and receiver is not None and _mentions(receiver, holding):
            given.add(params[0])
        params = params[1:]
    rest = {fn.args.vararg.arg} if fn.args.vararg is not None else set()  # what *args takes past the named ones
    for n, arg in enumerate(call.args):
        if _mentions(arg, holding):
            given |= set(params[n:]) | rest if isinstance(arg, ast.Starred) else \
                {params[n]} if n < len(params) else rest
    keywords = {a.arg for a in fn.args.kwonlyargs} | set(params)
    extra = {fn.args.kwarg.arg} if fn.args.kwarg is not None else set()  # what **kwargs takes
    for k in call.keywords:
        if _mentions(k.value, holding):
            given |= keywords if k.arg is None else {k.arg} if k.arg in keywords else extra
    return frozenset(given)


def _is_self_attribute(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"


def _bindings(fn: ast.FunctionDef) -> dict[int, str]:
    """id(call) -> the local name its value is bound to (`x = f(...)`, `with f(...) as x`)."""
    out = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Name):
            out[id(node.value)] = node.targets[0].id
        elif isinstance(node, ast.withitem) and isinstance(node.context_expr, ast.Call) \
                and isinstance(node.optional_vars, ast.Name):
            out[id(node.context_expr)] = node.optional_vars.id
    return out


def trace(module: str, function: str, query: str) -> list[str]:
    """The stays of the trip of `module.function`'s parameter `query`: each a module, in the order the query passes
    through them."""
    tracer = _Tracer()
    tracer.trip.append(module)
    tracer.walk(module, function, frozenset({query}))
    stays = []
    for m in tracer.trip:
        if not stays or stays[-1] != m:
            stays.append(m)
    return stays


def returns(stays: list[str]) -> list[str]:
    """The stays in a module the trip had already left."""
    return [m for n, m in enumerate(stays) if m in stays[:n]]


def test_the_trace_follows_the_query_through_imports_methods_callbacks_and_annotated_returns():
    stays = trace("cfir_jax.commands.retrieve", "run", "asked")
    # the calls the query does not go into are not its trip: the opening of the stores and the models, the config
    for opening in ("cfir_jax.retrieve.stores", "cfir_jax.model.checkpoint", "cfir_jax.core.config"):
        assert opening not in stays, opening
    assert stays[0] == "cfir_jax.commands.retrieve"
    assert "cfir_jax.api.index" in stays  # Index(...) and its methods, through the local name's class
    assert PIPELINE in stays  # the pipeline is reached, and entered:
    assert "cfir_jax.retrieve.entity_ranking" in stays  # ER, through the Retriever's `self.entities`
    assert "cfir_jax.retrieve.third_stage" in stays  # the third stage, through `self.third`


def test_a_query_passes_through_at_most_max_stays_modules_and_max_returns_returns():
    stays = trace("cfir_jax.commands.retrieve", "run", "asked")
    trip = " -> ".join(m.removeprefix("cfir_jax.") for m in stays)
    print(f"{len(stays)} stays, {len(returns(stays))} returns: {trip}")  # the trip, with -s
    assert len(stays) <= MAX_STAYS, f"{len(stays)} module stays (at most {MAX_STAYS}): {trip}"
    assert len(returns(stays)) <= MAX_RETURNS, f"returns to {returns(stays)} (at most {MAX_RETURNS}): {trip}"


def test_the_trip_reaches_each_concern_of_the_query_once_by_module():
    """The modules the trip reaches, each counted once: the floor under its stays (a stay per module at least), held
    at the 29 it reaches today, so that a new module on the query's path is a decision, not a drift."""
    reached = list(dict.fromkeys(trace("cfir_jax.commands.retrieve", "run", "asked")))
    assert len(reached) <= 29, f"{len(reached)} modules: {reached}"
