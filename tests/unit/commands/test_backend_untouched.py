"""Importing what the commands import before `jax.distributed.initialize` leaves the XLA backend unstarted: a
multi-host index build initialises the distributed runtime after parsing its flags and config, and JAX refuses once
any computation (even one run by a library at import time, as bm25s does) has started the backend."""

import subprocess
import sys

import pytest
from repo import ROOT

MODULES = ["cfir_jax.commands.flags", "cfir_jax.index.runner", "cfir_jax.index.collection_update",
           "cfir_jax.commands.index", "cfir_jax.stores.lexical"]


@pytest.mark.parametrize("module", MODULES)
def test_importing_leaves_the_backend_unstarted(module):
    code = (f"import {module}\n"
            "from jax._src import xla_bridge\n"
            "assert not xla_bridge._backends, 'the XLA backend was started on import'\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
