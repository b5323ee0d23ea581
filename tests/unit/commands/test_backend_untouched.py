"""Importing what the commands import before `jax.distributed.initialize` leaves the XLA backend unstarted: a
multi-host index build initialises the distributed runtime after parsing its flags and config, and JAX refuses once
any computation (even one run by a library at import time, as bm25s does) has started the backend."""

import subprocess
import sys

import pytest
from repo import ROOT

MODULES = ["cfir_jax.commands.flags", "cfir_jax.builders.runner", "cfir_jax.builders.collection_update",
           "cfir_jax.commands.build", "cfir_jax.stores.lexical"]


@pytest.mark.parametrize("module", MODULES)
def test_importing_leaves_the_backend_unstarted(module):
    code = (f"import {module}\n"
            "from jax._src import xla_bridge\n"
            "assert not xla_bridge._backends, 'the XLA backend was started on import'\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]


# Where each start stops: what `import cfir_jax` and a command's --help load, and what they must not.
HEAVY = ("jax", "flax", "orbax", "optax", "spacy", "torch", "sklearn", "matplotlib", "tensorflow_datasets", "grain")


@pytest.mark.parametrize("start", ["import cfir_jax", "retrieve.py --help", "train.py --help", "index.py --help"])
def test_a_light_start_loads_no_heavy_library(start, tmp_path):
    """`import cfir_jax` (a library caller's first line) and a command's --help load none of the libraries a
    computation needs (JAX and flax, spaCy, torch, ...): those load where a command first uses them."""
    out = tmp_path / "modules.txt"
    argv = ["-c", f"import sys, cfir_jax; open({str(out)!r}, 'w').write('\\n'.join(sys.modules))"] \
        if start == "import cfir_jax" else ["tests/helpers/modules_at_exit.py", str(out), *start.split()]
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                          env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = set(out.read_text().split())
    found = sorted(m for m in loaded if m.split(".")[0] in HEAVY)
    assert not found, f"{start} loaded {found[:10]}"
