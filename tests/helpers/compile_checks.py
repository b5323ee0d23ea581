"""Recompilation checks: every function jitted inside `traced_at_most(n)` may be traced n times at most."""

from __future__ import annotations

import contextlib
import functools
from unittest import mock

import chex
import jax

from cfir_jax.model import program_cache


@contextlib.contextmanager
def traced_at_most(n: int = 1):
    """Wraps each function given to `jax.jit` inside the block in `chex.assert_max_traces(fn, n)`: a further trace
    (a recompilation, e.g. for a batch of a new shape) raises AssertionError where it happens. chex counts per
    definition site, so two objects built by the same code (two text encoders) share one count. The programs this
    process keeps (`program_cache.memo`) are let go on the way in and out, so those made inside are counted and none
    counted leaks out."""
    real_jit = jax.jit
    chex.clear_trace_counter()  # counts of earlier tests must not carry over
    program_cache.forget()

    def jit(fun=None, /, **kwargs):
        if fun is None:  # used as @jax.jit(...) with options
            return functools.partial(jit, **kwargs)
        return real_jit(chex.assert_max_traces(fun, n=n), **kwargs)

    try:
        with mock.patch.object(jax, "jit", jit):
            yield
    finally:
        program_cache.forget()
