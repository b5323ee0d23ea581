"""The one keeper of compiled programs and model skeletons beside JAX's cache: in this process (`memo`) and whole on
disk (`DiskProgram`, `kept`), so that a process that ran them once neither traces nor lowers them again: the second
`retrieve.py --query` loads its two text-tower programs in milliseconds, and a model opened again in one process
(a service's reload, a second build, the two models of one query) makes nothing again.

JAX's persistent compilation cache (`cfir_jax.core.compile_cache`) saves the compile, but each process still traces
the function and lowers it to MLIR before it finds the entry. On the demo's query that was a third of a second (a
tenth of it importing MLIR), plus a tenth tracing the model's initialisers for its abstract shape. Here:
- `DiskProgram` keeps a jitted function's compiled executable (`jax.experimental.serialize_executable`: XLA's
  executable with its argument and result structures), keyed by all that decides it (below). A later process
  loads and calls it; nothing is traced.
- `kept(name, parts, make)` keeps any picklable value made by `make` (a model's graph and abstract state).
- `memo(name, key, make)` keeps a value for the life of the process: the jitted functions of a model structure (jit
  caches its compiles per function object) and its abstract model. `forget()` lets them go (a test that counts
  traces makes its own).

A key is the sha256 of: the entry's name and what its caller says it closes over (a model's config); the source of
the modules that define it (`code`: a change of the model's code is a new key); the versions of jax, jaxlib and flax;
the platform, device kind and XLA_FLAGS; and for a program, every argument's shape, dtype and sharding and the
static arguments. Entries are files `DIR/<key>` (DIR: the compilation cache's sibling `programs`): a sha256 of the
payload, then the payload (a pickle). An entry is written to a temp name and renamed. One whose checksum fails, or
that this JAX cannot load, is made again and rewritten; no entry is ever needed (no cache directory: the plain
path, as before). The directory is trusted as JAX's own cache beside it is: both hold machine code this process runs.
Only single-device programs are kept (a sharded or multi-process program takes the plain `jax.jit` path).

The directory is bounded as JAX's cache beside it is, by the same setting (`jax_compilation_cache_max_size`, 2 GiB
as `cfir_jax.core.compile_cache` sets it; -1: unbounded): every write removes the least recently used entries (a
load marks its entry used) until the directory fits, and the temporaries of writes that never finished (a killed
process, on any host) once they are an hour old. On the CPU the key holds the processor's features, since XLA
compiles for the host's instruction set: a directory shared by hosts of different CPUs (an NFS home) gives each its
own entries.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import logging
import os
import pickle
import platform
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import flax
import jax
import jaxlib
from jax._src import config as jax_config  # why: the thread's own switch of JAX's cache (no public name for it)
from jax.experimental import serialize_executable
from jax.experimental.compilation_cache import compilation_cache

from cfir_jax.core import compile_cache
from cfir_jax.core.errors import first_line
from cfir_jax.stores.atomic_write import atomic_file, is_temp_name

log = logging.getLogger("cfir_jax.programs")
_DIGEST = 32  # bytes of sha256 before the payload
_STALE_TEMP_S = 3600  # a temporary this old is a write that will never finish (its process died, on any host)
_MEMO: OrderedDict[tuple[str, str], Any] = OrderedDict()  # (name, key) -> value, most recently used last
_MEMO_KEPT = 16  # model structures' values kept (a process holds a few: one or two towers, their abstract models)
_MEMO_LOCK = threading.Lock()


def memo(name: str, key: str, make: Callable[[], Any]) -> Any:
    """The value `make()` made once in this process for (`name`, `key`: all that decides it, e.g. the model's
    config as JSON), the least recently used let go past a few. Made under a lock: two threads opening one model
    share one value."""
    with _MEMO_LOCK:
        if (name, key) in _MEMO:
            _MEMO.move_to_end((name, key))
            return _MEMO[name, key]
        value = _MEMO[name, key] = make()
        while len(_MEMO) > _MEMO_KEPT:
            _MEMO.popitem(last=False)
        return value


def forget() -> None:
    """Lets go of every value `memo` keeps (the next model opened makes its programs again, e.g. inside a test's
    `jax.jit` that counts traces)."""
    with _MEMO_LOCK:
        _MEMO.clear()


def directory() -> Path | None:
    """Where entries are kept: beside JAX's compilation cache when this project turned it on (`compile_cache.enable`),
    else None (nothing is kept)."""
    chosen = jax.config.jax_compilation_cache_dir
    ours = compile_cache.cache_dir()
    if not chosen or chosen != str(ours):
        return None
    return ours.parent / "programs"


@functools.cache
def code_digest(*modules: str) -> str:
    """sha256 of the source files of `modules` (dotted names; a package counts every .py file under it)."""
    h = hashlib.sha256()
    for name in modules:
        module = importlib.import_module(name)
        path = Path(module.__file__)
        files = sorted(path.parent.rglob("*.py")) if path.name == "__init__.py" else [path]
        for f in files:
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()


@functools.cache
def _environment() -> str:
    device = jax.local_devices()[0]
    cpu = cpu_features() if device.platform == "cpu" else ""
    return repr((jax.__version__, jaxlib.__version__, flax.__version__, device.platform, device.device_kind,
                 os.environ.get("XLA_FLAGS", ""), bool(jax.config.jax_enable_x64),
                 str(jax.config.jax_default_matmul_precision), cpu))


def cpu_features(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The processor's instruction-set features, sorted (x86's `flags`, Arm's `Features` line of the first
    processor in `cpuinfo`), after the machine's name; the machine's name and processor alone where the file is
    missing (another OS)."""
    found = ""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip().lower() in ("flags", "features"):
                    found = " ".join(sorted(value.split()))
                    break
    except OSError:
        pass
    return f"{platform.machine()} {found or platform.processor()}"


def _key(parts: Iterable[Any]) -> str:
    h = hashlib.sha256(_environment().encode())
    for part in parts:
        h.update(b"\0")
        h.update(str(part).encode())
    return h.hexdigest()


def _read(path: Path) -> bytes | None:
    """The payload of an entry, or None when missing or damaged."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    payload = data[_DIGEST:]
    if len(data) <= _DIGEST or hashlib.sha256(payload).digest() != data[:_DIGEST]:
        log.info("%s: damaged program cache entry, made again", path)
        return None
    with contextlib.suppress(OSError):  # used now: the last entry the size bound removes
        os.utime(path)
    return payload


def _write(path: Path, payload: bytes) -> None:
    """Writes an entry whole (`atomic_file`: a temporary name, then a rename); a directory that cannot be written
    keeps nothing."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path) as f:
            f.write(hashlib.sha256(payload).digest() + payload)
    except OSError as e:
        log.info("program cache %s not written: %s", path, e)
        return
    shrink(path.parent, int(jax.config.jax_compilation_cache_max_size), keep=path)


def shrink(where: Path, max_bytes: int, keep: Path | None = None) -> None:
    """Holds the directory `where` to `max_bytes` (< 0: unbounded) by removing its least recently used entries
    (oldest modification time first; a load touches its entry), never `keep` (the entry just written); and removes
    the temporaries of unfinished writes older than an hour, whichever host left them. Another process may be
    removing the same files: a file already gone is skipped."""
    now, entries = time.time(), []
    for f in where.iterdir():
        try:
            st = f.stat()
        except OSError:
            continue
        if is_temp_name(f.name):  # atomic_file's temporary
            if now - st.st_mtime > _STALE_TEMP_S:
                with contextlib.suppress(OSError):
                    f.unlink()
        elif f.is_file():
            entries.append((st.st_mtime, st.st_size, f))
    total = sum(size for _, size, _ in entries)
    if max_bytes < 0 or total <= max_bytes:
        return
    for _, size, f in sorted(entries, key=lambda e: e[0]):
        if f == keep:
            continue
        with contextlib.suppress(OSError):
            f.unlink()
        total -= size
        if total <= max_bytes:
            return


def kept(name: str, parts: Iterable[Any], make: Callable[[], Any]) -> Any:
    """The value `make()` made once for this key (`name`, `parts`: what decides it, strings), from disk when a
    process made it before; `make()` whenever nothing is kept (no directory, a damaged or unreadable entry)."""
    where = directory()
    if where is None:
        return make()
    path = where / f"{name}-{_key([name, *parts])}"
    payload = _read(path)
    if payload is not None:
        try:
            return pickle.loads(payload)
        except Exception as e:  # noqa: BLE001 - an entry of another version of a class: made again
            log.info("%s: unreadable program cache entry (%s), made again", path, e)
    value = make()
    _write(path, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
    return value


class DiskProgram:
    """A jitted function whose compiled executables are kept on disk, one per argument signature: called as the
    jitted function is (`program(*args, **static)`; `static`: its static keyword arguments).

    name, identity: the entry's name and what the function closes over (strings; e.g. the model's config);
    code: the modules whose source defines it.

    An executable is kept only when it was compiled here, not read from JAX's cache: on the CPU, an executable that
    JAX's cache gave back serializes without its code (it loads, then fails "Function ... not found" when run). So
    the compile that makes an entry bypasses JAX's cache, and an entry is written only once it has loaded and run
    here; an entry that fails its first run in a later process is removed and the program compiled as usual."""

    def __init__(self, jitted: Callable, name: str, identity: str, code: tuple[str, ...]):
        self.jitted, self.name, self.identity, self.code = jitted, name, identity, code
        self._compiled: dict[Any, Callable] = {}
        self._lock = threading.Lock()

    def cache_size(self) -> int:
        """How many argument signatures this program holds an executable for (as `jax.jit`'s `_cache_size`)."""
        return len(self._compiled)

    def __call__(self, *args, **static):
        leaves, tree = jax.tree.flatten(args)
        signature = (tree, tuple((getattr(x, "shape", ()), str(getattr(x, "dtype", type(x))),
                                  _placement(x)) for x in leaves), tuple(sorted(static.items())))
        compiled = self._compiled.get(signature)
        if compiled is None:
            with self._lock:
                compiled = self._compiled.get(signature)
                if compiled is None:
                    compiled, out = self._load(args, static, signature)
                    self._compiled[signature] = compiled
                    if out is not None:
                        return out  # the first run, which checked the executable
        return compiled(*args)

    def _load(self, args: tuple, static: dict, signature) -> tuple[Callable, Any]:
        """(the program for this signature, its output on `args` when it ran them already, else None)."""
        plain = functools.partial(self.jitted, **static)
        where = directory()
        if where is None or jax.process_count() > 1 or any(p[2] not in ("host", "0") for p in signature[1]):
            return plain, None  # kept by JAX's own cache only
        here = jax.local_devices()[:1]  # the program's one device (by default it would be every device)
        path = where / f"program-{self.name}-{_key([self.identity, code_digest(*self.code), signature])}"
        payload = _read(path)
        if payload is not None:
            try:
                loaded = serialize_executable.deserialize_and_load(*pickle.loads(payload), execution_devices=here)
                return loaded, jax.block_until_ready(loaded(*args))
            except Exception as e:  # noqa: BLE001 - an entry this runtime cannot load or run: made again
                log.info("%s: kept program not usable here (%s); compiling it", path, first_line(e, 200))
        with _jax_cache_off():
            compiled = self.jitted.lower(*args, **static).compile()
        entry = serialize_executable.serialize(compiled)
        try:
            loaded = serialize_executable.deserialize_and_load(*entry, execution_devices=here)
            out = jax.block_until_ready(loaded(*args))
        except Exception as e:  # noqa: BLE001 - not kept (JAX's cache answered the compile): compiled as usual
            log.info("program %s not kept: its executable does not load (%s)", self.name, first_line(e, 200))
            return plain, None
        _write(path, pickle.dumps(entry, protocol=pickle.HIGHEST_PROTOCOL))
        return loaded, out


@contextlib.contextmanager
def _jax_cache_off():
    """JAX's persistent compilation cache off in this thread while inside (its use is decided once per process, so
    it is looked up again on the way in and out)."""
    compilation_cache.reset_cache()
    try:
        with jax_config.enable_compilation_cache(False):
            yield
    finally:
        compilation_cache.reset_cache()


def _placement(x: Any) -> str:
    """'host' for a host array (numpy, a Python number), '0' for a jax array on this process's first device alone,
    else its sharding (such a program is not kept)."""
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        return "host"
    devices = getattr(sharding, "device_set", set())
    if len(devices) == 1 and next(iter(devices)) == jax.local_devices()[0]:
        return "0"
    return str(sharding)
