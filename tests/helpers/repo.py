"""The repository as the tests see it: its root, the tiny config, its commands run in a subprocess, and BEiT-3's own
tokenizer where one is at hand."""

import os
import subprocess
import sys
from pathlib import Path

import command_server
import pytest

ROOT = Path(__file__).resolve().parents[2]
# The real BEiT-3 tokenizer, only for the tests that compare against it (parity with XLMRobertaTokenizer): the file
# CFIR_BEIT3_SPM names, else the shared copy beside the repository. It is never committed (download:
# github.com/addf400/files/releases/download/beit3/beit3.spm).
SPM_PATH = Path(os.environ.get("CFIR_BEIT3_SPM") or ROOT.parent / "shared" / "data" / "beit3.spm")
NEEDS_BEIT3_SPM = pytest.mark.skipif(
    not SPM_PATH.is_file(),
    reason=f"needs BEiT-3's beit3.spm, not at {SPM_PATH}: set CFIR_BEIT3_SPM=/path/to/beit3.spm")

TINY_CONFIG = "configs/demo.py:tiny"


def run_script(*args, check=True, env=None, fresh=False):
    """One of the repository's commands (`index.py ...`) in a process of its own, from the repository root: forked
    from a process that has imported JAX and the command modules already (command_server), or with `fresh` (and for
    any other script) a new interpreter."""
    env = {**os.environ, **(env or {})}
    if fresh:
        proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    else:
        proc = command_server.run(args, env=env, cwd=ROOT, timeout=900)
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


# The first build's output, kept for the tests of what a user sees (progress bars forced on: stderr is no TTY).
FIRST_RUN: dict[str, subprocess.CompletedProcess] = {}
