"""The C library's heap, tuned for the two kinds of process this project runs (glibc only; elsewhere nothing is done).

- **A command that runs XLA:CPU programs step after step** (training, the caption pretraining, encoding a
  collection): each execution of a compiled program asks for its whole scratch space at once (the demo's training
  step: one 293 MiB buffer) from one of XLA's threads. glibc serves a block that large from a fresh `mmap` and unmaps
  it when freed, so the next step faults every page of it in again: 75,000 page faults and 167-183 ms of kernel time
  in each of the demo's steps of 0.23-0.26 s. `reuse_freed_memory` makes every thread allocate from the main heap
  with no `mmap` and keeps up to 1 GiB of freed memory at its top: the same buffer is reused, step after step. Done
  only where JAX will run on the CPU (on a GPU or TPU host the scratch space lives on the device), before any thread
  has its own heap, and never where `GLIBC_TUNABLES` says how the heap should behave.
- **A service after a reload** (`release_freed`): glibc keeps what a process frees for its next allocations. A reload
  opens the new index beside the serving one (two side by side at its peak); once the old one is dropped, the pages
  its arrays and objects held stay in the process's heap, free but counted in its RSS, wherever a live allocation
  sits above them. `malloc_trim(0)` gives every whole free page back.
"""

from __future__ import annotations

import ctypes
import os

from cfir_jax.core.platforms import accelerator_present

# mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
KEPT_AT_TOP = 1 << 30  # freed memory kept at the heap's top for the next step, at most (bytes)


def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except OSError:  # not glibc
        return None


_LIBC = _libc()


def release_freed() -> bool:
    """Returns the heap's free pages to the system (ctypes releases the GIL meanwhile: serving threads go on); False
    where the C library has no malloc_trim."""
    if _LIBC is None:
        return False
    _LIBC.malloc_trim(0)
    return True


def runs_on_cpu(env=os.environ) -> bool:
    """Whether JAX will run this process's programs on the CPU, decided before JAX starts: JAX_PLATFORMS when set
    (cpu alone), else neither a TPU device file nor a GPU plugin (`cfir_jax.core.platforms`, the rule by which
    `import cfir_jax` sets JAX_PLATFORMS=cpu where libtpu is installed without a chip)."""
    platforms = [p.strip() for p in env.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms:
        return all(p == "cpu" for p in platforms)
    return not accelerator_present()


def reuse_freed_memory(env=os.environ) -> bool:
    """For a command whose XLA:CPU programs run step after step: one heap for every thread, no `mmap` for large
    blocks, up to KEPT_AT_TOP of freed memory kept (the module's docstring says why). Call it before JAX starts its
    threads. True when applied; False off the CPU, under a GLIBC_TUNABLES of the user's, or without glibc."""
    if _LIBC is None or "GLIBC_TUNABLES" in env or not runs_on_cpu(env):
        return False
    return all(_LIBC.mallopt(param, value) == 1
               for param, value in ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, KEPT_AT_TOP)))
