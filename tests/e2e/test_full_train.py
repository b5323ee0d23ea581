"""train.py on a Full config (configs/demo.py:tiny,full): D-BEiT-3 Full trained from the tiny world's images in
W/train_full, exported whole to W/model_full; resumed runs equal uninterrupted ones; one writer per workdir."""

import json
import os
import subprocess
from pathlib import Path

import command_server
import jax
import numpy as np
import pytest
from repo import ROOT

from cfir_jax.model import beit3 as model_lib
from cfir_jax.model import checkpoint

CONFIG = "configs/demo.py:tiny,full"


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """A workdir holding only W/corpus: the tiny synthetic world as index.py's first stage writes it."""
    from cfir_jax.data.synthetic import SyntheticConfig, generate

    w = tmp_path_factory.mktemp("full")
    generate(w / "corpus", SyntheticConfig.tiny())
    return w


def _workdir(world: Path, tmp_path: Path, name: str) -> Path:
    w = tmp_path / name
    w.mkdir()
    (w / "corpus").symlink_to(world / "corpus")
    return w


def _train_py(workdir: Path, **env) -> subprocess.CompletedProcess:
    """train.py on CONFIG (forked from the tests' command server; its compiles kept in the run's cache, as every
    command's: tests/conftest.py)."""
    return command_server.run(["train.py", "--config", CONFIG, "--workdir", workdir], {**os.environ, **env},
                              timeout=600)


def _config():
    from cfir_jax.core.cli import load_config_file

    return load_config_file(str(ROOT / CONFIG))


def _params(model_dir: Path) -> dict:
    from flax import nnx

    model = checkpoint.load_model(model_dir)
    return {model_lib.param_path(p): np.asarray(v) for p, v in
            jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))[0]}


def test_train_py_trains_both_towers_of_the_full_model_and_exports_it_beside_cfirs(world, tmp_path):
    w = _workdir(world, tmp_path, "w")
    out = _train_py(w)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("final: ") and "skipped_images=0" in out.stdout and "Traceback" not in out.stderr
    run = w / "train_full"
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [2, 4]
    assert json.loads((run / "timing.jsonl").read_text().splitlines()[0])["steps_per_epoch"] == 2  # 42 pairs / 16
    assert not (w / "train").exists() and not (w / "model").exists()  # never mixed with CFIR's run and model
    manifest = checkpoint.read_model_manifest(w / "model_full")
    assert manifest["trained"] == "full" and manifest["train_images"] == "pixels"
    assert manifest["train_text"] == "document" and manifest["trained_from"] == "scratch"
    # Both towers moved away from the seed's model the run started from.
    cfg = _config()
    initial = model_lib.create_model(cfg.model, cfg.train.seed)
    for tower in ("vision", "text"):
        assert manifest[f"{tower}_fingerprint"] == checkpoint.fingerprint(_loaded(w), tower)
        assert manifest[f"{tower}_fingerprint"] != checkpoint.fingerprint(initial, tower), tower
    # A rerun has nothing left to do and keeps the model.
    again = _train_py(w)
    assert again.returncode == 0 and "already trained to step 4" in again.stdout, again.stderr[-3000:]
    assert checkpoint.read_model_manifest(w / "model_full")["created"] == manifest["created"]


def _loaded(w: Path):
    return checkpoint.load_model(w / "model_full")


def test_interrupted_full_run_resumes_to_the_uninterrupted_model(world, tmp_path, monkeypatch):
    """A run stopped before its step 3 (after the step-2 checkpoint) and rerun exports the uninterrupted run's
    model bit for bit (train state and image pipeline position restored)."""
    from cfir_jax.data.image_pipeline import PairBatches
    from cfir_jax.training.runs import run_full

    cfg = _config()
    cfg.train.async_checkpoints = False  # the interruption lands right after the step-2 save
    straight = run_full(cfg, _workdir(world, tmp_path, "straight"), progress=False)
    resumed_dir = _workdir(world, tmp_path, "resumed")
    serve = PairBatches.__next__

    def interrupted(self):
        if self.step == 3:
            raise KeyboardInterrupt("interrupted")
        return serve(self)

    monkeypatch.setattr(PairBatches, "__next__", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_full(cfg, resumed_dir, progress=False)
    assert not (resumed_dir / "model_full").exists()
    monkeypatch.setattr(PairBatches, "__next__", serve)
    resumed = run_full(cfg, resumed_dir, progress=False)
    assert straight.start_step == 0 and resumed.start_step == 2 and resumed.num_steps == 4
    a, b = _params(tmp_path / "straight" / "model_full"), _params(resumed_dir / "model_full")
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert straight.metrics == resumed.metrics
    assert (tmp_path / "straight" / "train_full" / "metrics.jsonl").read_text() == \
        (resumed_dir / "train_full" / "metrics.jsonl").read_text()


def test_a_second_writer_of_the_workdir_is_refused_in_one_line(world, tmp_path):
    from cfir_jax.stores import lock

    w = _workdir(world, tmp_path, "w")
    with lock.hold(w, command="first writer"):
        out = _train_py(w)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "another writer is running" in out.stderr and "first writer" in out.stderr
    assert not (w / "train_full").exists() and not (w / "model_full").exists()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_process_train_py(workdir: Path) -> list[subprocess.CompletedProcess]:
    """train.py as processes 0 and 1 of a jax.distributed job on localhost, one CPU device each."""
    port = _free_port()
    procs = []
    for pid in (0, 1):
        env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
                   JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(pid))
        procs.append(command_server.popen(["train.py", "--config", CONFIG, "--workdir", workdir], env, ROOT,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:  # a pair that disagrees on a collective would hang: do not leave it behind
                p.kill()
    return [subprocess.CompletedProcess(p.args, p.returncode, o, e) for p, (o, e) in zip(procs, outs)]


@pytest.mark.slow
def test_two_process_full_run_equals_one_process_on_as_many_devices(world, tmp_path):
    """2 processes x 1 device (each reading its own half of every global batch from the pipeline) train the model
    that 1 process x 2 devices trains; a rerun of the finished 2-process job agrees to keep the model, on both."""
    two = _workdir(world, tmp_path, "two")
    runs = _two_process_train_py(two)
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-3000:] + "\n-----\n" + runs[1].stderr[-3000:]
    one = _workdir(world, tmp_path, "one")
    single = _train_py(one, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    assert single.returncode == 0, single.stderr[-3000:]
    a, b = _params(one / "model_full"), _params(two / "model_full")
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-4, atol=1e-6, err_msg=k)
    metrics = [[json.loads(x)["loss"] for x in (w / "train_full" / "metrics.jsonl").read_text().splitlines()]
               for w in (one, two)]
    np.testing.assert_allclose(metrics[1], metrics[0], rtol=1e-5)
    created = checkpoint.read_model_manifest(two / "model_full")["created"]
    again = _two_process_train_py(two)
    assert all(r.returncode == 0 for r in again), again[0].stderr[-3000:] + again[1].stderr[-3000:]
    assert "already trained to step 4" in again[0].stdout
    assert checkpoint.read_model_manifest(two / "model_full")["created"] == created
