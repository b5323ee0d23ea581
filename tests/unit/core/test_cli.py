"""What the command lines tell a user: --help names the overrides and the stages; setup.sh names its sets."""

import logging
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest
from repo import ROOT

from cfir_jax.builders.descriptor import stages
from cfir_jax.core import progress


@pytest.mark.parametrize("command", ["index.py", "train.py", "retrieve.py"])
def test_help_mentions_config_overrides(command):
    proc = subprocess.run([sys.executable, command, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert "--config.SECTION.FIELD=VALUE" in text and "--config.index.entity_index.k=1000" in text
    if command == "index.py":
        assert ", ".join(stages()) in text


def test_setup_script_refuses_an_unknown_set():
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh"), "everything"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "demo|test" in proc.stderr


@pytest.mark.parametrize("value, want", [("", None), ("1", False), ("0", True)])
def test_progress_env_switches_bars(monkeypatch, value, want):
    monkeypatch.setenv("CFIR_PROGRESS", value)
    assert progress.disabled() is want


def test_only_process_zero_of_a_multi_host_run_draws_a_bar(monkeypatch):
    """Process 1 of a jax.distributed run (faked: jax's process_index says so) draws no bar, and what the bar
    followed gives the same answer."""
    import jax

    shown = progress.bar(total=3, show=True)
    assert not shown.disable
    shown.close()
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    hidden = progress.bar(total=3, show=True)
    assert hidden.disable
    hidden.close()
    assert progress.map_chunks(lambda xs: [x * 2 for x in xs], list(range(9)), "x", chunk=4) == list(range(0, 18, 2))


def test_map_chunks_equals_one_call():
    items = list(range(70))
    assert progress.map_chunks(lambda xs: [x * x for x in xs], items, desc="t", chunk=32) == [x * x for x in items]


@pytest.mark.parametrize("verbosity, ours, libraries", [(0, logging.WARNING, logging.WARNING),
                                                        (1, logging.INFO, logging.WARNING),
                                                        (2, logging.INFO, logging.INFO)])
def test_verbosity_keeps_checkpoint_library_quiet_until_vv(verbosity, ours, libraries):
    root = logging.getLogger()
    saved = root.level, {n: logging.getLogger(n).level for n in ("absl", "orbax")}
    try:
        progress.set_log_levels(verbosity)
        assert root.level == ours
        assert logging.getLogger("absl").getEffectiveLevel() == libraries
        assert logging.getLogger("orbax").getEffectiveLevel() == libraries
    finally:
        root.setLevel(saved[0])
        for name, level in saved[1].items():
            logging.getLogger(name).setLevel(level)
        progress.set_log_levels(0)


@pytest.mark.skipif(shutil.which("script") is None, reason="needs util-linux `script` to run under a pseudo-terminal")
def test_bars_draw_on_a_terminal_that_reports_no_size(tmp_path):
    """Under `script` the pty is 0 x 0 (as on some CI runners): tqdm alone hides its bar there; ours still draws."""
    code = ("from cfir_jax.core import progress; "
            "progress.map_chunks(lambda xs: xs, list(range(50)), desc='demo', chunk=10)")
    log = tmp_path / "typescript"
    env = {k: v for k, v in os.environ.items() if k not in ("CFIR_PROGRESS", "COLUMNS", "LINES")}
    subprocess.run(["script", "-q", "-e", "-c", f"{shlex.quote(sys.executable)} -c {shlex.quote(code)}", str(log)],
                   cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True, timeout=120, check=True)
    assert re.search(r"demo: 100%\|.*\| 50/50 \[", log.read_text(errors="replace")), log.read_text()[-500:]


@pytest.mark.parametrize(
    "environ, specs, devices, want",
    [
        ({}, {"libtpu"}, [], "cpu"),  # libtpu on a host without chips: the CPU, quietly
        ({"JAX_PLATFORMS": "tpu"}, {"libtpu"}, [], None),  # the user's choice stands
        ({}, set(), [], None),  # no libtpu: JAX as it is
        ({}, {"libtpu"}, ["/dev/accel0"], None),  # a TPU host
        ({}, {"libtpu"}, ["/dev/vfio/0"], None),  # a TPU host (v5e/v6e)
        ({}, {"libtpu", "jax_cuda12_plugin"}, [], None),  # a GPU host keeps its platform
    ],
)
def test_tpu_platform_left_out_only_without_chips(environ, specs, devices, want):
    import cfir_jax

    def find_spec(name):
        return object() if name in specs else None

    def device_files(pattern):
        return [d for d in devices if d.startswith(pattern.split("*")[0].split("[")[0])]

    assert cfir_jax.tpu_free_platforms(environ, find_spec, device_files) == want


def test_commands_start_without_libtpu_noise_on_a_cpu_host():
    """The test set installs libtpu; a command on this TPU-less host must not print libtpu's probe warnings."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    code = "import cfir_jax, jax; print(jax.default_backend())"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "TPU_ACCELERATOR_TYPE" not in proc.stderr and "libtpu" not in proc.stderr, proc.stderr
    assert proc.stdout.strip() in ("cpu", "gpu", "tpu")
