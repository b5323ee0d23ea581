import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
# The real BEiT-3 tokenizer, only for the tests that compare against it (parity with XLMRobertaTokenizer): the file
# CFIR_BEIT3_SPM names, else the shared copy beside the repository. It is never committed (download:
# github.com/addf400/files/releases/download/beit3/beit3.spm).
SPM_PATH = Path(os.environ.get("CFIR_BEIT3_SPM") or ROOT.parent / "shared" / "data" / "beit3.spm")
NEEDS_BEIT3_SPM = pytest.mark.skipif(
    not SPM_PATH.is_file(),
    reason=f"needs BEiT-3's beit3.spm, not at {SPM_PATH}: set CFIR_BEIT3_SPM=/path/to/beit3.spm")


@pytest.fixture(scope="session")
def synthetic_spm(tmp_path_factory) -> Path:
    """The tiny synthetic world's sentencepiece model (beit3.spm's id conventions): a tokenizer for every test that
    needs one but not BEiT-3's own vocabulary."""
    from cfir_jax.data.synthetic import SyntheticConfig, build_world, train_tokenizer

    world = build_world(SyntheticConfig.tiny())
    path = tmp_path_factory.mktemp("spm") / "synthetic.spm"
    texts = [d.text for d in world.documents] + [i.caption for i in world.images]
    train_tokenizer(texts, path, SyntheticConfig.tiny().vocab_size)
    return path


TINY_CONFIG = "configs/demo.py:tiny"


def run_script(*args, check=True, env=None):
    """One of the repository's commands (`index.py ...`) in a subprocess, from the repository root."""
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, **(env or {})})
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


# The first build's output, kept for the tests of what a user sees (progress bars forced on: stderr is no TTY).
FIRST_RUN: dict[str, subprocess.CompletedProcess] = {}


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    """A tiny world indexed and trained once for the whole session (every test module that needs one shares it)."""
    w = tmp_path_factory.mktemp("demo")
    FIRST_RUN["index"] = run_script("index.py", "--config", TINY_CONFIG, "--workdir", str(w),
                                    env={"CFIR_PROGRESS": "1"})
    FIRST_RUN["train"] = run_script("train.py", "--config", TINY_CONFIG, "--workdir", str(w), "-v",
                                    env={"CFIR_PROGRESS": "1"})
    return w


@pytest.fixture(scope="session")
def config():
    from cfir_jax.core.cli import load_config_file

    return load_config_file(str(ROOT / TINY_CONFIG))
