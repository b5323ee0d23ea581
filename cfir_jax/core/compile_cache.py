"""JAX's persistent compilation cache, on for every command: a second `retrieve.py --query` (or a second build, a
service's restart) reads its compiled programs from disk instead of compiling them again.

The cache lives in the user's cache directory, `$XDG_CACHE_HOME/cfir-jax/jax` (`~/.cache/cfir-jax/jax` without
XDG_CACHE_HOME); `CFIR_CACHE_DIR=DIR` moves it to `DIR/jax`. It is never inside a workdir, which may be read-only or
shared by users whose machines compile differently. A cache directory that cannot be made leaves the cache off (the
command runs, compiling as before). A JAX_COMPILATION_CACHE_DIR the user set is kept.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping
from pathlib import Path

# Every program is kept, however small or quick to compile: the CPU's programs compile in tens of milliseconds each,
# and a query's dozen of them is most of its start (JAX's defaults keep only programs that took a second).
SETTINGS = {
    "jax_persistent_cache_min_compile_time_secs": 0,
    "jax_persistent_cache_min_entry_size_bytes": -1,  # -1: no minimum size, and none chosen by JAX for the disk
    # A bound turns on JAX's least-recently-used eviction and its file lock, so that processes sharing the cache
    # (the service's workers, two commands at once) never read an entry half written.
    "jax_compilation_cache_max_size": 2 << 30,
}
DIR_SETTING = "jax_compilation_cache_dir"


def cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """Where the compiled programs are kept: CFIR_CACHE_DIR/jax, else XDG_CACHE_HOME (or ~/.cache)/cfir-jax/jax."""
    if environ.get("CFIR_CACHE_DIR"):
        return Path(environ["CFIR_CACHE_DIR"]).expanduser() / "jax"
    base = environ.get("XDG_CACHE_HOME") or os.path.join(environ.get("HOME") or os.path.expanduser("~"), ".cache")
    return Path(base) / "cfir-jax" / "jax"


def enable(environ: MutableMapping[str, str] = os.environ) -> Path | None:
    """Turns the cache on, before the first compile; returns its directory, or None when it stays off (another
    compilation cache directory is in force, the user's JAX_COMPILATION_CACHE_DIR, or the directory cannot be made).

    Before JAX is imported the settings go into the environment (JAX reads them when it loads, and the processes this
    one starts inherit them); once it is loaded, into its config, and JAX looks for the cache again at its next
    compile.
    """
    path = cache_dir(environ)
    jax = sys.modules.get("jax")
    chosen = jax.config.jax_compilation_cache_dir if jax is not None else environ.get(DIR_SETTING.upper())
    if chosen:
        return path if chosen == str(path) else None
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    if not os.access(path, os.W_OK | os.X_OK):
        return None
    settings = {DIR_SETTING: str(path), **SETTINGS}
    if jax is None:
        for name, value in settings.items():
            environ.setdefault(name.upper(), str(value))
        return path
    # why: JAX is loaded already (a library caller's process); its cache is looked up again after a reset
    from jax.experimental.compilation_cache import compilation_cache

    for name, value in settings.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()
    return path
