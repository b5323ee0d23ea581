"""JAX's persistent compilation cache (cfir_jax.core.compile_cache): in the user's cache directory, moved by
CFIR_CACHE_DIR, off where it cannot be made, and a second process compiles nothing that the first one compiled."""

import json
import os
import subprocess
import sys
from pathlib import Path

from repo import ROOT

from cfir_jax.core.compile_cache import cache_dir

# A process that turns the cache on as a command does (before JAX loads), compiles a small program and reports what
# it compiled and what it found in the cache.
PROGRAM = """
import json
from cfir_jax.core import compile_cache

path = compile_cache.enable()
import jax, jax.numpy as jnp
from jax._src import dispatch

seen = {"programs": 0, "hits": 0, "misses": 0}  # programs: compiled or read from the cache
def on_event(event, **kw):
    seen["hits"] += event == "/jax/compilation_cache/cache_hits"
    seen["misses"] += event == "/jax/compilation_cache/cache_misses"
def on_duration(event, duration, **kw):
    seen["programs"] += event == dispatch.BACKEND_COMPILE_EVENT
jax.monitoring.register_event_listener(on_event)
jax.monitoring.register_event_duration_secs_listener(on_duration)
x = jnp.arange(16.0).reshape(4, 4)
jax.jit(lambda a: jnp.tanh(a) @ a.T)(x).block_until_ready()
print(json.dumps({"path": None if path is None else str(path), "setting": jax.config.jax_compilation_cache_dir,
                  **seen}))
"""


def _run(env: dict, code: str = PROGRAM) -> dict:
    base = {k: v for k, v in os.environ.items()
            if k not in ("CFIR_CACHE_DIR", "XDG_CACHE_HOME", "JAX_COMPILATION_CACHE_DIR")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**base, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_the_cache_is_in_the_users_cache_directory_unless_cfir_cache_dir_moves_it(tmp_path):
    assert cache_dir({"HOME": "/home/u"}) == Path("/home/u/.cache/cfir-jax/jax")
    assert cache_dir({"HOME": "/home/u", "XDG_CACHE_HOME": "/c"}) == Path("/c/cfir-jax/jax")
    assert cache_dir({"HOME": "/home/u", "XDG_CACHE_HOME": "/c", "CFIR_CACHE_DIR": "/fast"}) == Path("/fast/jax")


def test_a_second_process_compiles_nothing_the_first_compiled(tmp_path):
    """Two processes with HOME and XDG_CACHE_HOME in an empty folder: the first compiles and writes its programs
    under XDG_CACHE_HOME/cfir-jax/jax; the second finds every one there, compiles none and writes no new entry."""
    env = {"HOME": str(tmp_path / "home"), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    first = _run(env)
    where = tmp_path / "cache" / "cfir-jax" / "jax"
    assert first["path"] == first["setting"] == str(where)
    entries = sorted(p.name for p in where.glob("*-cache"))
    assert first["programs"] >= 1 and first["misses"] == first["programs"] == len(entries), (first, entries)
    second = _run(env)
    assert second["misses"] == 0 and second["hits"] == second["programs"] == first["programs"], second
    assert sorted(p.name for p in where.glob("*-cache")) == entries


def test_a_cache_folder_that_cannot_be_made_leaves_the_cache_off(tmp_path):
    """CFIR_CACHE_DIR below a file (or anywhere the folder cannot be made): the program runs, compiling as before."""
    (tmp_path / "file").write_text("")
    out = _run({"CFIR_CACHE_DIR": str(tmp_path / "file"), "HOME": str(tmp_path)})
    assert out["path"] is None and out["setting"] is None and out["programs"] >= 1 and out["hits"] == 0


def test_the_users_own_jax_cache_directory_is_kept(tmp_path):
    mine = str(tmp_path / "mine")
    out = _run({"JAX_COMPILATION_CACHE_DIR": mine, "CFIR_CACHE_DIR": str(tmp_path / "cfir")})
    assert out["path"] is None and out["setting"] == mine and not (tmp_path / "cfir").exists()


def test_a_process_that_loaded_jax_and_compiled_turns_the_cache_on_for_its_next_compiles(tmp_path):
    """A library caller's process (JAX loaded, a program compiled before): the setting goes into JAX's config and
    the next new program is written to the cache."""
    code = ("import jax, jax.numpy as jnp\n"
            "jax.jit(lambda a: a + 1)(jnp.ones(3)).block_until_ready()\n"
            "from cfir_jax.core import compile_cache\n"
            "path = compile_cache.enable()\n"
            "jax.jit(lambda a: a * 3)(jnp.ones(5)).block_until_ready()\n"
            "import json; print(json.dumps({'path': str(path), 'setting': jax.config.jax_compilation_cache_dir}))\n")
    out = _run({"CFIR_CACHE_DIR": str(tmp_path)}, code)
    assert out["path"] == out["setting"] == str(tmp_path / "jax")
    assert list((tmp_path / "jax").glob("*-cache"))
