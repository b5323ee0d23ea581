"""Programs kept whole on disk (cfir_jax.model.program_cache): a program compiled once is loaded, not traced, by a
later process (here: a new `DiskProgram` of a new function object, as a new process makes); its answers are the
compiled program's; a damaged entry is made again; a change of the code, of what the program closes over, or of
an argument's shape is a new entry; a program over several devices, or with no cache directory, is plain `jax.jit`."""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from repo import ROOT

from cfir_jax.model import program_cache
from cfir_jax.model.program_cache import DiskProgram

CODE = ("cfir_jax.model.program_cache",)


@pytest.fixture()
def kept_in(tmp_path, monkeypatch):
    monkeypatch.setattr(program_cache, "directory", lambda: tmp_path)
    return tmp_path


def _program(traces: list, identity: str = "w", code=CODE, name: str = "f") -> DiskProgram:
    """A new function object each call, as each process makes its own; `traces` counts its traces."""

    @jax.jit
    def f(params, x):
        traces.append(1)
        return jnp.tanh(x @ params["w"]) + params["b"]

    return DiskProgram(f, name, identity, code)


def _args(rows: int = 4):
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(8, 8)), jnp.float32), "b": jnp.ones(8, jnp.float32)}
    return params, rng.normal(size=(rows, 8)).astype(np.float32)


def test_a_later_process_loads_the_program_and_traces_nothing(kept_in):
    params, x = _args()
    first, later = [], []
    want = np.asarray(_program(first)(params, x))
    assert first == [1] and len(list(kept_in.iterdir())) == 1
    got = np.asarray(_program(later)(params, x))
    assert later == []  # loaded whole: not traced, not lowered
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got, np.tanh(x @ np.asarray(params["w"])) + 1, rtol=1e-5, atol=1e-6)


def test_a_damaged_entry_is_compiled_again_and_rewritten(kept_in):
    params, x = _args()
    want = np.asarray(_program([])(params, x))
    (entry,) = kept_in.iterdir()
    data = bytearray(entry.read_bytes())
    data[len(data) // 2] ^= 0xFF
    entry.write_bytes(bytes(data))
    traces = []
    np.testing.assert_array_equal(np.asarray(_program(traces)(params, x)), want)
    assert traces == [1]  # made again, not loaded from the damaged bytes
    later = []
    np.testing.assert_array_equal(np.asarray(_program(later)(params, x)), want)
    assert later == []  # the rewritten entry loads


@pytest.mark.parametrize("change", ["identity", "code", "shape", "static"])
def test_what_decides_a_program_is_in_its_key(kept_in, change):
    params, x = _args()
    _program([])(params, x)
    traces = []
    if change == "identity":
        _program(traces, identity="another structure")(params, x)
    elif change == "code":
        _program(traces, code=("cfir_jax.core.compile_cache",))(params, x)
    elif change == "shape":
        _program(traces)(params, _args(rows=6)[1])
    else:
        @functools.partial(jax.jit, static_argnames="k")
        def g(params, x, k):
            traces.append(1)
            return jnp.tanh(x @ params["w"])[:, :k]

        program = DiskProgram(g, "g", "w", CODE)
        assert program(params, x, k=2).shape == (4, 2)
        assert program(params, x, k=3).shape == (4, 3)
        assert traces == [1, 1] and len(list(kept_in.glob("program-g-*"))) == 2
        return
    assert traces == [1] and len(list(kept_in.iterdir())) == 2


def test_no_cache_directory_is_plain_jit(monkeypatch, tmp_path):
    monkeypatch.setattr(program_cache, "directory", lambda: None)
    params, x = _args()
    traces = []
    program = _program(traces)
    program(params, x)
    _program(traces)(params, x)
    assert traces == [1, 1] and not list(tmp_path.iterdir())


# Two CPU devices in a process of its own: a program whose arguments sit on the second device is not kept.
ON_ANOTHER_DEVICE = """
import sys
from pathlib import Path
import jax, jax.numpy as jnp, numpy as np
from cfir_jax.model import program_cache
where = Path(sys.argv[1])
program_cache.directory = lambda: where
program = program_cache.DiskProgram(jax.jit(lambda a, b: a @ b), "two", "w", ("cfir_jax.model.program_cache",))
x = np.ones((4, 4), np.float32)
first, second = jax.local_devices()[:2]
program(jax.device_put(x, second), jax.device_put(x, second)).block_until_ready()
kept_after_second = len(list(where.iterdir()))
program(jax.device_put(x, first), x).block_until_ready()
print(kept_after_second, len(list(where.iterdir())))
"""


def test_a_program_on_another_device_is_not_kept(tmp_path):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", ON_ANOTHER_DEVICE, str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["0", "1"]  # the second device's program: not kept; the first's: kept


def test_kept_values_are_made_once_and_remade_when_damaged(kept_in):
    made = []

    def make():
        made.append(1)
        return {"graph": ("a", 1)}

    assert program_cache.kept("v", ["k"], make) == {"graph": ("a", 1)}
    assert program_cache.kept("v", ["k"], make) == {"graph": ("a", 1)} and made == [1]
    (entry,) = kept_in.iterdir()
    entry.write_bytes(entry.read_bytes()[:-3])
    assert program_cache.kept("v", ["k"], make) == {"graph": ("a", 1)} and made == [1, 1]
    assert program_cache.kept("v", ["other"], make) and made == [1, 1, 1]


def test_the_directory_is_the_compilation_caches_sibling_only_when_this_project_turned_it_on(monkeypatch, tmp_path):
    from cfir_jax.core import compile_cache

    before = jax.config.jax_compilation_cache_dir
    monkeypatch.setenv("CFIR_CACHE_DIR", str(tmp_path))
    try:
        jax.config.update("jax_compilation_cache_dir", str(compile_cache.cache_dir()))
        assert program_cache.directory() == tmp_path / "programs"
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "the users own"))
        assert program_cache.directory() is None  # a JAX cache the user chose: nothing kept beside it
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


@pytest.fixture()
def max_size():
    """Sets JAX's `jax_compilation_cache_max_size`, which bounds this directory too, and restores it."""
    before = jax.config.jax_compilation_cache_max_size
    yield lambda n: jax.config.update("jax_compilation_cache_max_size", n)
    jax.config.update("jax_compilation_cache_max_size", before)


def test_the_directory_keeps_to_the_size_bound_removing_the_least_recently_used(kept_in, max_size):
    value = {"graph": "x" * 4000}
    program_cache.kept("a", ["1"], lambda: value)
    (a,) = kept_in.iterdir()
    max_size(2 * a.stat().st_size + 100)  # room for two entries
    program_cache.kept("b", ["1"], lambda: value)
    os.utime(a, (1, 1)), os.utime(next(kept_in.glob("b-*")), (2, 2))  # a then b, long ago
    made = []
    assert program_cache.kept("a", ["1"], lambda: made.append(1) or value) == value and not made  # a load: used now
    program_cache.kept("c", ["1"], lambda: value)  # over the bound: b, the least recently used, goes
    assert sorted(p.name[0] for p in kept_in.iterdir()) == ["a", "c"]
    max_size(-1)  # unbounded: nothing removed
    program_cache.kept("d", ["1"], lambda: value)
    assert sorted(p.name[0] for p in kept_in.iterdir()) == ["a", "c", "d"]


def test_an_unfinished_write_is_swept_after_an_hour_whichever_host_left_it(kept_in):
    old, fresh = kept_in / ".program-f-1.tmp-otherhost-99-ab12", kept_in / ".program-f-2.tmp-otherhost-98-cd34"
    for f in (old, fresh):
        f.write_bytes(b"half")
    os.utime(old, (0, 0))
    program_cache.kept("v", ["k"], lambda: 1)
    assert not old.exists() and fresh.exists()


def test_on_the_cpu_the_processors_features_are_in_the_key(kept_in, monkeypatch, tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: sse2 avx2 fma\n\nprocessor\t: 1\nflags\t\t: sse2\n")
    assert program_cache.cpu_features(str(info)).endswith("avx2 fma sse2")  # the first processor's, sorted
    info.write_text("processor\t: 0\nFeatures\t: fp asimd sve\n")
    assert program_cache.cpu_features(str(info)).endswith("asimd fp sve")
    assert program_cache.cpu_features(str(tmp_path / "none"))  # another OS: the machine's name
    params, x = _args()
    _program([])(params, x)
    monkeypatch.setattr(program_cache, "cpu_features", lambda: "x86_64 sse2")  # a host of another CPU
    program_cache._environment.cache_clear()
    try:
        traces = []
        _program(traces)(params, x)
        assert traces == [1] and len(list(kept_in.glob("program-*"))) == 2  # its own entry, not the first host's
    finally:
        program_cache._environment.cache_clear()


def test_a_process_makes_a_value_once_per_key_and_forget_lets_it_go():
    program_cache.forget()
    made = []
    make = lambda: made.append(1) or object()  # noqa: E731
    first = program_cache.memo("m", "k", make)
    assert program_cache.memo("m", "k", make) is first and made == [1]
    assert program_cache.memo("m", "other", make) is not first and made == [1, 1]
    for n in range(program_cache._MEMO_KEPT):  # past the bound the least recently used goes: "k" was used last
        program_cache.memo("fill", str(n), make)
    assert program_cache.memo("m", "k", make) is not first
    program_cache.forget()
    assert program_cache.memo("m", "other", make) is not None and len(made) == 3 + program_cache._MEMO_KEPT + 1

