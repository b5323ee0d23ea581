"""Training the language expert: sharding equivalence, multi-process, kill/resume, frozen parameters, learning."""

import json
import os
import signal
import socket
import subprocess
import time

import chex
import command_server
import jax
import numpy as np
import pytest
from repo import ROOT
from train_fixtures import planted_data, tiny_config

from cfir_jax.model import beit3 as model_lib
from cfir_jax.model import checkpoint
from cfir_jax.training import loop
from cfir_jax.training.state import init_state, make_setup
from cfir_jax.training.step import global_batch_arrays, make_train_step
from cfir_jax.training.tasks import TextTask

WORKER = str(ROOT / "tests" / "helpers" / "train_worker.py")
# The key projection's bias has an exactly zero gradient (a per-query constant shift of all attention logits), so
# Adam turns float noise into lr-sized random updates there: it is compared only for staying negligible.
NOISE_ONLY = "k_proj/bias"


def _env(devices: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    env.pop("PYTEST_XDIST_WORKER", None)
    return env


def _worker(*args, devices: int = 1) -> subprocess.CompletedProcess:
    """train_worker.py ARGS on `devices` CPU devices, to its end, its output captured (forked from the tests'
    command server: tests/helpers/command_server.py)."""
    return command_server.run([WORKER, *args], _env(devices), timeout=600)


def _start(*args, devices: int = 1, **streams):
    """train_worker.py ARGS on `devices` CPU devices, started (subprocess.Popen's interface; `streams` as its)."""
    return command_server.popen([WORKER, *args], _env(devices), **streams)


def _assert_same_params(a: dict, b: dict, rtol: float = 1e-5):
    assert a.keys() == b.keys()
    for k in a:
        if k.endswith(NOISE_ONLY):
            assert np.abs(a[k]).max() < 1e-2 and np.abs(b[k]).max() < 1e-2, k
            continue
        scale = max(float(np.abs(a[k]).max()), 1e-3)
        np.testing.assert_allclose(a[k], b[k], rtol=rtol, atol=rtol * scale, err_msg=k)


@pytest.mark.slow
def test_sharded_step_equals_single_device(tmp_path):
    """8 fake CPU devices (4 x 2 data x fsdp, parameters sharded) vs one device; pure data parallelism over 8 devices:
    test_two_processes_equal_single_device."""
    out = tmp_path / "sharded.npz"
    proc = _worker("sharded", out, devices=8)
    assert proc.returncode == 0, proc.stderr[-3000:]
    z = np.load(out)
    np.testing.assert_allclose(z["fsdp_loss_8"], z["fsdp_loss_1"], rtol=1e-5)
    one = {k.split("/", 1)[1]: z[k] for k in z.files if k.startswith("fsdp_1/")}
    many = {k.split("/", 1)[1]: z[k] for k in z.files if k.startswith("fsdp_8/")}
    assert len(one) > 10
    _assert_same_params(one, many)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # out of the quick tier: 20-45 s each on the shared 2-core machine
def test_two_processes_equal_single_device(tmp_path):
    """2 processes x 4 devices on localhost (jax.distributed, gloo) vs the single-device run of the same batch."""
    port = str(_free_port())
    out = tmp_path / "dist.npz"
    procs = [_start("dist", pid, port, out, devices=4, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for pid in (0, 1)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs[0][-3000:] + logs[1][-3000:]
    single = tmp_path / "single.npz"
    proc = _worker("single", single)
    assert proc.returncode == 0, proc.stderr[-3000:]
    z, s = np.load(out), np.load(single)
    np.testing.assert_allclose(z["loss"], s["loss"], rtol=1e-5)
    _assert_same_params({k: z[k] for k in z.files if k != "loss"}, {k: s[k] for k in s.files if k != "loss"})


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One uninterrupted `train_worker.py run` (8 steps, a checkpoint every 2): (its workdir, its parameters' npz),
    what the killed and the preempted runs must end equal to. Only read."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    whole, out = folder / "whole", folder / "whole.npz"
    proc = _worker("run", whole, out, -1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return whole, out


@pytest.mark.slow
def test_killed_and_resumed_run_equals_uninterrupted(tmp_path, uninterrupted):
    """SIGKILL after the step-4 checkpoint (blocked before step 5), resume: same params and metrics log."""
    (whole, whole_npz), broken = uninterrupted, tmp_path / "broken"
    victim = _start("run", broken, tmp_path / "x.npz", 5, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (broken / "checkpoints" / "4").is_dir() and time.time() < deadline:
        assert victim.poll() is None, "training ended before it could be killed"
        time.sleep(0.5)
    time.sleep(2)  # the run is now blocked before step 5
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert not (tmp_path / "x.npz").exists()

    proc = _worker("run", broken, tmp_path / "resumed.npz", -1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = np.load(whole_npz), np.load(tmp_path / "resumed.npz")
    for k in a.files:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert (whole / "metrics.jsonl").read_text() == (broken / "metrics.jsonl").read_text()
    # Training time: the resumed run is timed over two segments that cover every step (those redone after the
    # checkpoint twice: they were paid for twice).
    from cfir_jax.eval.train_time import train_time

    timed, resumed = train_time(whole), train_time(broken)
    assert timed.steps == json.loads((whole / "metrics.jsonl").read_text().splitlines()[-1])["step"] <= resumed.steps
    assert timed.hardware == resumed.hardware == f"1 x cpu ({os.cpu_count()} cores)"
    assert (broken / "timing.jsonl").read_text().count("hardware") == 2


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path, uninterrupted):
    """Preemption: SIGTERM mid-run -> checkpoint at the current step, exit 0; the rerun finishes identically."""
    work = tmp_path / "pre"
    proc = _start("run", work, tmp_path / "x.npz", -2, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not (work / "metrics.jsonl").is_file() or not (work / "metrics.jsonl").read_text().strip():
        assert proc.poll() is None and time.time() < deadline, "training ended before SIGTERM"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    saved = sorted(int(p.name) for p in (work / "checkpoints").iterdir() if p.name.isdigit())
    assert saved and saved[-1] < 8 and "SIGTERM" in err
    assert not (tmp_path / "x.npz").exists()
    done = _worker("run", work, tmp_path / "y.npz", -1)
    assert done.returncode == 0, done.stderr[-2000:]
    a, b = np.load(tmp_path / "y.npz"), np.load(uninterrupted[1])
    for k in a.files:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _start_two_processes(*args: str) -> list[subprocess.Popen]:
    """`train_worker.py distrun` as processes 0 and 1 of a 2 x 4-device jax.distributed job."""
    port = str(_free_port())
    return [_start("distrun", pid, port, *args, devices=4, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for pid in (0, 1)]


def _wait_all(procs: list[subprocess.Popen], timeout: float = 600) -> list[str]:
    """Stderr of each process; all must exit 0 (within `timeout`; killed otherwise, as a deadlocked pair would hang)."""
    try:
        errs = [p.communicate(timeout=timeout)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), errs[0][-3000:] + "\n-----\n" + errs[1][-3000:]
    return errs


@pytest.mark.slow
def test_sigterm_to_one_of_two_processes_saves_the_same_step_on_both(tmp_path):
    """2 processes x 4 devices (jax.distributed): SIGTERM reaches process 1 only. Both agree on a step, save it (one
    checkpoint, the same step) and exit 0; resuming finishes exactly as an uninterrupted run does."""
    import re

    work = tmp_path / "pre"
    procs = _start_two_processes(str(work), str(tmp_path / "x.npz"), "-2")  # 0.5 s per batch
    deadline = time.time() + 300
    while not (work / "metrics.jsonl").is_file() or not (work / "metrics.jsonl").read_text().strip():
        assert all(p.poll() is None for p in procs) and time.time() < deadline, "training ended before SIGTERM"
        time.sleep(0.2)
    procs[1].send_signal(signal.SIGTERM)
    errs = _wait_all(procs, timeout=300)
    saved = [re.findall(r"saved checkpoint at step (\d+)", err) for err in errs]
    assert len(saved[0]) == 1 and saved[0] == saved[1], errs
    step = int(saved[0][0])
    assert step < 8 and sorted(p.name for p in (work / "checkpoints").iterdir() if p.name.isdigit()) == [str(step)]
    assert not (tmp_path / "x.npz").exists()

    _wait_all(_start_two_processes(str(work), str(tmp_path / "resumed.npz"), "-1"))
    _wait_all(_start_two_processes(str(tmp_path / "whole"), str(tmp_path / "whole.npz"), "-1"))
    a, b = np.load(tmp_path / "whole.npz"), np.load(tmp_path / "resumed.npz")
    for k in a.files:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert (tmp_path / "whole" / "metrics.jsonl").read_text() == (work / "metrics.jsonl").read_text()


def test_layer_lr_decay_scales():
    """BEiT-3's fine-tuning rule: embeddings = layer 0, layers.i = i + 1, the rest = L + 1; decay ** (L + 1 - layer)."""
    from cfir_jax.training.partition import layer_lr_scales

    tree = {"B": {"embed_positions": np.zeros((5, 2)), "layers": {"fc1": {"kernel": np.zeros((3, 2, 2))}},
                  "layer_norm": {"scale": np.zeros(2)}}, "language_head": {"kernel": np.zeros((2, 2))}}
    s = layer_lr_scales(tree, num_layers=3, decay=0.5)
    assert float(s["B"]["embed_positions"]) == 0.5 ** 4
    np.testing.assert_allclose(s["B"]["layers"]["fc1"]["kernel"].ravel(), [0.5 ** 3, 0.5 ** 2, 0.5])
    assert float(s["B"]["layer_norm"]["scale"]) == 1.0 and float(s["language_head"]["kernel"]) == 1.0


def test_frozen_parameters_are_bit_identical_after_training(tmp_path):
    """Init from a model directory, export with its vision tower: every frozen parameter is unchanged bit for bit
    (the vision tower never leaves the host; the token table is restored, never updated)."""
    import re

    from flax import nnx

    cfg = tiny_config(num_steps=3)
    init = model_lib.create_model(cfg.model, seed=5)
    checkpoint.save_model(init, tmp_path / "init")
    cfg.train.update(init_model=str(tmp_path / "init"), export_model=str(tmp_path / "init"))
    loop.run(cfg, tmp_path / "run", TextTask(planted_data(with_eval=False)))
    after = checkpoint.load_model(tmp_path / "run" / "model")

    def flat(m):
        state = nnx.to_pure_dict(nnx.state(m, nnx.Param))
        return {model_lib.param_path(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(state)[0]}

    b, a = flat(init), flat(after)
    trained = [k for k in b if re.fullmatch(cfg.train.trainable[0][0], k)]
    frozen = [k for k in b if k not in trained]
    assert any(k.startswith("A/") for k in frozen) and "text_embed/embedding" in frozen
    for k in frozen:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert all(not np.array_equal(a[k], b[k]) for k in trained if not k.endswith(NOISE_ONLY))
    manifest = checkpoint.read_model_manifest(tmp_path / "run" / "model")
    assert manifest["vision_fingerprint"] == checkpoint.fingerprint(init, "vision")
    assert manifest["text_fingerprint"] != checkpoint.fingerprint(init, "text")


def test_loss_falls_and_validation_recall_rises(tmp_path):
    cfg = tiny_config(num_steps=60, lr=2e-3, warmup_steps=5, log_every=5, eval_every=30, checkpoint_every=1000,
                      global_batch=16)
    cfg.model.update(dropout=0.0, drop_path_rate=0.0)
    loop.run(cfg, tmp_path, TextTask(planted_data(num_pairs=64)))
    log = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    first, last = log[0], log[-1]
    assert last["loss"] < 0.3 * first["loss"]
    evals = [e for e in log if "val/recall_at_1" in e]
    chance = 1 / 64
    assert evals[-1]["val/recall_at_1"] > 10 * chance
    assert evals[-1]["val/mrr_at_10"] > evals[0]["val/mrr_at_10"]


def test_no_recompilation_after_first_step():
    from compile_checks import traced_at_most

    cfg = tiny_config()
    data = planted_data()
    with traced_at_most(1):
        setup = make_setup(cfg, 10)
        state, frozen = init_state(cfg, setup, None)
        step_fn = make_train_step(cfg, setup)
        for i in range(4):
            state, _ = step_fn(state, frozen, global_batch_arrays(data, i, cfg, setup.mesh))
        # The guard is live: a batch of another length is a new trace, refused.
        short = global_batch_arrays(data, 4, cfg, setup.mesh)
        short = {k: v[:, :-1] if k in ("ids", "mask") else v for k, v in short.items()}
        with pytest.raises(AssertionError, match="traced > 1"):
            step_fn(state, frozen, short)


def _params_after_one_step(cfg):
    setup = make_setup(cfg, 10)
    state, frozen = init_state(cfg, setup, None)
    state, metrics = make_train_step(cfg, setup)(
        state, frozen, global_batch_arrays(planted_data(), 0, cfg, setup.mesh))
    return float(metrics["loss"]), {model_lib.param_path(p): np.asarray(v) for p, v in
                                    jax.tree_util.tree_flatten_with_path(state["params"])[0]}


def test_gradient_caching_equals_full_batch():
    """grad_accum_steps=4 computes the exact full-batch contrastive gradient (not 4 smaller losses)."""
    full_cfg, cached_cfg = tiny_config(global_batch=16), tiny_config(global_batch=16, grad_accum_steps=4)
    for cfg in (full_cfg, cached_cfg):
        cfg.model.update(dropout=0.0, drop_path_rate=0.0)
    loss_a, a = _params_after_one_step(full_cfg)
    loss_b, b = _params_after_one_step(cached_cfg)
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    _assert_same_params(a, b, rtol=1e-4)


def test_extra_negatives_make_the_task_harder():
    base_cfg, neg_cfg = tiny_config(), tiny_config(extra_negatives=32)
    for cfg in (base_cfg, neg_cfg):
        cfg.model.update(dropout=0.0, drop_path_rate=0.0)
    loss_a, _ = _params_after_one_step(base_cfg)
    loss_b, _ = _params_after_one_step(neg_cfg)
    assert loss_b > loss_a  # the same batch with 32 more columns in the text->image softmax


def test_batches_are_a_function_of_the_step():
    data = planted_data(num_pairs=50)
    epoch0 = np.concatenate([data.batch_rows(s, 8, seed=3) for s in range(6)])
    assert len(set(epoch0.tolist())) == 48  # a permutation, tail dropped
    np.testing.assert_array_equal(data.batch_rows(4, 8, seed=3), data.batch_rows(4, 8, seed=3))
    assert not np.array_equal(data.batch_rows(0, 8, seed=3), data.batch_rows(6, 8, seed=3))  # next epoch reshuffled


def test_loss_matches_reference_formula():
    """Symmetric CE with labels arange(B) (unilm's ClipLoss on one device), computed in float64 numpy."""
    from cfir_jax.training.loss import contrastive_loss

    rng = np.random.default_rng(0)
    t, v = rng.normal(size=(6, 8)), rng.normal(size=(6, 8))
    t /= np.linalg.norm(t, axis=1, keepdims=True)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    s = 2.5
    logits = np.exp(s) * t @ v.T

    def ce(lg):
        lg = lg - lg.max(1, keepdims=True)
        return -(np.diag(lg) - np.log(np.exp(lg).sum(1))).mean()

    want = 0.5 * (ce(logits) + ce(logits.T))
    got, _ = contrastive_loss(jax.numpy.asarray(t, "float32"), jax.numpy.asarray(v, "float32"),
                              jax.numpy.asarray(s, "float32"))
    assert float(got) == pytest.approx(want, rel=1e-5)
    chex.assert_shape(got, ())


def test_init_model_of_another_size_is_refused(tmp_path):
    from cfir_jax.core.errors import CfirError

    cfg = tiny_config()
    other = tiny_config()
    other.model.update(embed_dim=48, num_heads=3)
    checkpoint.save_model(model_lib.create_model(other.model), tmp_path / "other")
    cfg.train.init_model = str(tmp_path / "other")
    with pytest.raises(CfirError, match="embed_dim=48 but the config has 32"):
        loop.run(cfg, tmp_path / "run", TextTask(planted_data(with_eval=False)))
