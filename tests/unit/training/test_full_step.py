"""The D-BEiT-3 Full train step (cfir_jax/training/full_step.py): both towers' gradient against the float64 torchscale
oracle, gradient caching, what trains under each trainable set, 8 devices against 1, and its TPU compile."""

import os
import subprocess
import sys

import command_server
import jax
import numpy as np
import pytest
from flax import nnx
from repo import ROOT
from train_fixtures import full_batch, full_config

from cfir_jax.model import beit3 as model_lib
from cfir_jax.training.full_step import batch_shardings, make_encode, make_full_step, make_grads
from cfir_jax.training.optim import trainable_filter
from cfir_jax.training.state import init_state, make_setup

WORKER = str(ROOT / "tests" / "helpers" / "full_step_worker.py")


def _flat(tree) -> dict:
    return {
        model_lib.param_path(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]
    }


def _split(model, cfg, setup):
    """(params, frozen) of a concrete model, placed with the setup's shardings."""
    _, params, frozen = nnx.split(model, trainable_filter(cfg.train.trainable), ...)
    return (
        jax.device_put(nnx.to_pure_dict(params), setup.param_shardings),
        jax.device_put(nnx.to_pure_dict(frozen), setup.frozen_shardings),
    )


def _per_device_bytes(abstract_tree) -> int:
    """Bytes one device holds of abstract arrays with shardings (shard shape x itemsize)."""
    return sum(int(np.prod(a.sharding.shard_shape(a.shape))) * a.dtype.itemsize for a in jax.tree.leaves(abstract_tree))


def _grads(cfg, setup, params, frozen, batch):
    batch = jax.device_put(batch, batch_shardings(setup.mesh))
    (loss, aux), grads = jax.jit(make_grads(cfg, setup))(params, frozen, batch, jax.random.key(0))
    return float(loss), _flat(grads)


def _torch_reference_grads(torch_model, batch) -> tuple[float, dict]:
    """The symmetric contrastive loss of unilm's retrieval fine-tuning over the valid pairs only, in float64, and the
    gradient of every parameter (an unused one: zeros), keyed as the checkpoint."""
    import torch
    import torch.nn.functional as F

    valid = batch["valid"]
    pixels = torch.from_numpy(batch["pixels"][valid]).double().permute(0, 3, 1, 2) / 255.0
    pixels = (pixels - 0.5) / 0.5
    ids = torch.from_numpy(batch["ids"][valid]).long()
    mask = torch.from_numpy(batch["mask"][valid])
    torch_model.zero_grad()
    image, _ = torch_model.encode_image(pixels)
    text, _ = torch_model.encode_text(ids, mask)
    logits = torch_model.logit_scale.exp() * image @ text.t()
    labels = torch.arange(len(ids))
    loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2
    loss.backward()
    grads = {
        k: (p.grad if p.grad is not None else torch.zeros_like(p)).numpy() for k, p in torch_model.named_parameters()
    }
    return float(loss.detach()), grads


def test_full_step_gradient_equals_the_float64_torchscale_gradient():
    """Both towers, heads, embeddings and the temperature: our float32 gradient of one Full batch (a corrupt image
    masked by `valid`) equals torchscale's float64 gradient over the valid pairs alone."""
    from torch_reference import random_reference, state_dict_numpy

    from cfir_jax.model.convert import load_torch_checkpoint, torch_to_params

    cfg = full_config()
    torch_model = random_reference(cfg.model, seed=1).double()
    model = load_torch_checkpoint(state_dict_numpy(torch_model), cfg.model)
    setup = make_setup(cfg, 10, jax.devices()[:1])
    params, frozen = _split(model, cfg, setup)
    batch = full_batch()
    assert not batch["valid"].all()
    loss, grads = _grads(cfg, setup, params, frozen, batch)
    ref_loss, ref_raw = _torch_reference_grads(torch_model, batch)
    ref = _flat(torch_to_params({k.removeprefix("beit3."): v for k, v in ref_raw.items()}, cfg.model))
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert set(grads) == set(ref) - {"vision_embed/mask_token"}
    for name, g in grads.items():
        scale = float(np.abs(ref[name]).max())
        assert scale > 0 or name.endswith("k_proj/bias"), name  # every trained tensor gets a gradient
        np.testing.assert_allclose(g, ref[name], rtol=0, atol=2e-4 * max(scale, 1e-3), err_msg=name)
    for tower in ("A/", "B/"):  # the image and the text tower's layers both carry real gradients
        assert any(np.abs(g).max() > 1e-3 for k, g in grads.items() if k.startswith(tower + "layers/fc1"))


@pytest.mark.slow  # out of the quick tier: 20-45 s each on the shared 2-core machine
def test_gradient_caching_equals_the_one_batch_gradient_for_both_towers():
    """grad_accum_steps=2: the exact gradient of the whole batch's loss, in micro-batches of half the rows."""
    one, cached = full_config(), full_config(grad_accum_steps=2)
    setup = make_setup(one, 10, jax.devices()[:1])
    state, frozen = init_state(one, setup, None)
    batch = full_batch()
    loss_a, a = _grads(one, setup, state["params"], frozen, batch)
    loss_b, b = _grads(cached, setup, state["params"], frozen, batch)
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    assert a.keys() == b.keys() and any(k.startswith("A/") for k in a) and any(k.startswith("B/") for k in a)
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=0, atol=1e-5 * max(float(np.abs(a[k]).max()), 1e-3), err_msg=k)
    # Half of a batch is another loss: caching is not just the mean of two micro-batch gradients.
    half = {key: v[:4] for key, v in batch.items()}
    loss_half, _ = _grads(one, setup, state["params"], frozen, half)
    assert abs(loss_half - loss_a) > 1e-3


def _encode_after_steps(cfg, steps: int = 2):
    """Parameters and both towers' embeddings of one batch before and after `steps` Full steps."""
    setup = make_setup(cfg, 10, jax.devices()[:1])
    state, frozen = init_state(cfg, setup, None)
    encode = jax.jit(make_encode(setup))
    batch = jax.device_put(full_batch(), batch_shardings(setup.mesh))
    before = _flat(state["params"]), encode(state["params"], frozen, batch)
    step = make_full_step(cfg, setup)
    for _ in range(steps):
        state, metrics = step(state, frozen, batch)
        assert np.isfinite(float(metrics["loss"])) and int(metrics["valid_pairs"]) == 7
    after = _flat(state["params"]), encode(state["params"], frozen, batch)
    return before, after, _flat(frozen)


@pytest.mark.slow  # out of the quick tier: 20-45 s each on the shared 2-core machine
def test_language_expert_set_leaves_the_image_tower_frozen_and_full_moves_everything():
    (p0, (img0, txt0)), (p1, (img1, txt1)), frozen = _encode_after_steps(full_config(trainable="language_expert"))
    assert set(p0) == {k for k in p0 if k.startswith(("B/", "language_head/", "logit_scale"))}
    assert {"A/layers/fc1/kernel", "vision_embed/proj/kernel", "vision_head/kernel", "text_embed/embedding"} <= set(
        frozen
    )
    np.testing.assert_array_equal(np.asarray(img1), np.asarray(img0))  # the vision tower computes what it did
    assert np.abs(np.asarray(txt1) - np.asarray(txt0)).max() > 1e-4
    assert all(np.any(p1[k] != p0[k]) for k in p0)

    (p0, (img0, txt0)), (p1, (img1, txt1)), frozen = _encode_after_steps(full_config())
    assert set(frozen) == {"vision_embed/mask_token"}  # unused by retrieval
    moved = {k for k in p0 if np.any(p1[k] != p0[k])}
    assert (
        moved == set(p0)
        and len(p0) == len(jax.tree.leaves(nnx.state(model_lib.abstract_model(full_config().model), nnx.Param))) - 1
    )
    assert np.abs(np.asarray(img1) - np.asarray(img0)).max() > 1e-4
    assert np.abs(np.asarray(txt1) - np.asarray(txt0)).max() > 1e-4


@pytest.mark.slow
def test_eight_devices_data_by_fsdp_equal_one_device(tmp_path):
    """Two Full steps on 8 fake CPU devices (data=4 x fsdp=2, parameters FSDP-sharded) equal one device, with gradient
    caching (its equality with one batch: test_gradient_caching_equals_the_one_batch_gradient_for_both_towers)."""
    out = tmp_path / "full.npz"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = command_server.run([WORKER, out], env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    z = np.load(out)
    accum = 2
    np.testing.assert_allclose(z[f"a{accum}_loss_8"], z[f"a{accum}_loss_1"], rtol=1e-5)
    one = {k.split("/", 1)[1]: z[k] for k in z.files if k.startswith(f"a{accum}_1/")}
    many = {k.split("/", 1)[1]: z[k] for k in z.files if k.startswith(f"a{accum}_8/")}
    assert one.keys() == many.keys() and len(one) > 50
    for k in one:
        if k.endswith("k_proj/bias"):  # an exactly-zero gradient: Adam turns float noise into lr-sized steps
            assert np.abs(one[k]).max() < 1e-2 and np.abs(many[k]).max() < 1e-2, k
            continue
        # Two Adam steps at lr 1e-3 move an element by up to 2e-3, and a wrong gradient by as much: 1e-6 is a
        # thousandth of that (Adam divides tiny gradients by their own size, so their float noise shows ~1e-8).
        np.testing.assert_allclose(many[k], one[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.slow  # out of the quick tier: 20-45 s each on the shared 2-core machine
def test_train_full_compiles_for_a_tpu_topology_with_the_state_it_shards():
    """compile-only: a Full config's train command is the Full step alone; on v5e 2x2 its arguments are the sharded
    state, frozen set and batch, the donated state comes back in place, and FSDP divides the state over the chips."""
    from cfir_jax.aot import programs as programs_lib
    from cfir_jax.aot.compile import compile_program
    from cfir_jax.aot.topology import libtpu_problem, resolve
    from cfir_jax.core.config import FSDP_RULES

    # As tests/unit/aot/test_compile_only.py: CI installs libtpu (scripts/setup.sh test).
    if problem := libtpu_problem():
        pytest.skip(f"libtpu unavailable: {problem}")
    topology = resolve("v5e:2x2")
    assert [p.name for p in programs_lib.programs("train", full_config(), topology)] == ["train_full"]
    assert "train_full" not in [p.name for p in programs_lib.programs("train", full_config(images="cache"), topology)]
    results = {}
    for name, mesh in (("data", dict(data=-1, fsdp=1)), ("fsdp", dict(data=1, fsdp=-1))):
        cfg = full_config(global_batch=16)
        # 128 dims: TPU tiles arrays in 128 lanes, so at 64 the tile padding would swamp the arrays' own bytes.
        cfg.model.update(embed_dim=128, num_heads=4)
        cfg.mesh.update(logical_axis_rules=list(FSDP_RULES), **mesh)
        (program,) = programs_lib.train_full(cfg, topology)
        result = results[name] = compile_program(program, topology)
        state, frozen, batch = program.args
        expected = _per_device_bytes((state, frozen, batch))
        # What the compiler says each device holds = the sharded arguments, up to the tile padding of the 32-wide
        # FSDP shards (measured: 1.5x).
        slack = 1.1 if name == "data" else 1.6
        assert result.fits and expected <= result.arguments <= slack * expected + 65536, name
        assert result.aliased >= 0.9 * _per_device_bytes(state), name
    # Both towers' state split over the 4 chips (measured 0.38 of the data-parallel replica, padding included).
    assert results["fsdp"].arguments < 0.5 * results["data"].arguments


class Recording:
    """The image pipeline (PairBatches) as the loop sees it, recording the documents of every batch it serves;
    `crash_at`: raise before serving that step (an interrupted run)."""

    def __init__(self, batches, crash_at: int = -1):
        self.batches, self.crash_at, self.served = batches, crash_at, []

    def __next__(self) -> dict:
        if self.batches.step == self.crash_at:
            raise KeyboardInterrupt("interrupted")
        batch = next(self.batches)
        self.served.append(batch["doc_rows"])
        return batch

    @property
    def skipped(self) -> int:
        return self.batches.skipped

    def get_state(self) -> dict:
        return self.batches.get_state()

    def set_state(self, state: dict) -> None:
        self.batches.set_state(state)


@pytest.mark.slow  # out of the quick tier: 20-45 s each on the shared 2-core machine
def test_interrupted_full_run_resumes_bit_equal_with_the_pipeline_position(world_corpus, tmp_path):
    """The real image pipeline over the tiny world (two broken images among the first pairs): a run interrupted after
    its step-2 checkpoint resumes to the uninterrupted run's batches 3 and 4 and its parameters, bit for bit."""
    from cfir_jax.data.image_pipeline import PairBatches
    from cfir_jax.training import loop
    from cfir_jax.training.tasks import FullTask

    def train_full(cfg, workdir, batches, ids, mask):
        return loop.run(cfg, workdir, FullTask(batches, ids, mask))

    corpus, pairs, _ = world_corpus
    cfg = full_config(num_steps=4, checkpoint_every=2, grad_accum_steps=2)
    tokens = full_batch(batch=corpus.num_documents, seed=7)  # token ids per document row
    ids, mask = tokens["ids"], tokens["mask"]

    def batches(crash_at=-1):
        return Recording(PairBatches(corpus, pairs, global_batch=8, image_size=32, seed=3), crash_at)

    whole = batches()
    straight = train_full(cfg, tmp_path / "straight", whole, ids, mask)
    with pytest.raises(KeyboardInterrupt):
        train_full(cfg, tmp_path / "resumed", batches(crash_at=3), ids, mask)
    again = batches()
    resumed = train_full(cfg, tmp_path / "resumed", again, ids, mask)
    assert resumed.start_step == 2 and again.batches.step == 4 and again.skipped == whole.skipped
    np.testing.assert_array_equal(np.stack(again.served), np.stack(whole.served[2:]))
    a, b = _flat(straight.params), _flat(resumed.params)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert straight.metrics == resumed.metrics and straight.metrics["skipped_images"] == whole.skipped


@pytest.mark.benchmark
@pytest.mark.slow  # out of the quick tier: 20-45 s each on the shared 2-core machine
def test_throughput_benchmark_times_the_same_trained_set_as_torchscale():
    """benchmarks/train_throughput.py --step full at tiny size: it refuses to compare when the two sides train
    different parameter sets, so a run to the ratio line means torchscale's whole-model step trains what ours does."""
    root = ROOT
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "benchmarks/train_throughput.py", "--step", "full", "--size", "tiny",
                          "--image-size", "32", "--batch", "4", "--steps", "1", "--warmup", "1"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "trained parameters" in out.stdout and "32 px" in out.stdout, out.stdout
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("[fp32] Full step") and float(line.split()[-1].rstrip("x")) > 0, line


def test_full_init_model_restores_both_towers_and_refuses_another_image_size(tmp_path):
    """A Full run started from a model directory (BEiT-3 converted) takes both towers from it; a model converted at
    another image size (another position table) is refused in one line naming the conversion."""
    from cfir_jax.core.errors import CfirError
    from cfir_jax.model import checkpoint

    cfg = full_config()
    source = model_lib.create_model(cfg.model, seed=7)
    checkpoint.save_model(source, tmp_path / "same")
    setup = make_setup(cfg, 4)
    state, frozen = init_state(cfg, setup, str(tmp_path / "same"))
    restored = _flat(state["params"]) | _flat(frozen)
    saved = _flat(nnx.to_pure_dict(nnx.state(source, nnx.Param)))
    assert restored.keys() == saved.keys() and any(k.startswith("A/") for k in restored)
    for k in saved:
        np.testing.assert_array_equal(restored[k], saved[k], err_msg=k)

    other = full_config()
    other.model.image_size = 64
    checkpoint.save_model(model_lib.create_model(other.model), tmp_path / "other")
    with pytest.raises(CfirError, match=r"image_size=64 but the config has 32; convert .* --config.model.image_size=64"
                       ) as e:
        init_state(cfg, setup, str(tmp_path / "other"))
    assert "\n" not in str(e.value)
