"""benchmarks/accelerator.py without an accelerator: the torchscale loss builds every tensor on its inputs' device (a
CPU tensor beside CUDA logits stopped the train part on the GPU), and the command line picks the parts, the sizes
and one process per measured unit."""

import json
import time

import accelerator
import accelerator_serve
import common
import pytest
import torch
from torch.overrides import TorchFunctionMode


class _Devices(TorchFunctionMode):
    """Records the device of every tensor any torch function returns."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple) else (out,):
            if isinstance(t, torch.Tensor):
                self.seen.add(t.device.type)
        return out


def test_torch_contrastive_loss_builds_every_tensor_on_the_inputs_device():
    # "meta" stands in for CUDA on a host without one: tensors that are not on the CPU, with shapes and no data.
    text, image = torch.empty(6, 8, device="meta"), torch.empty(6, 8, device="meta")
    scale = torch.empty((), device="meta")
    with _Devices() as mode:
        loss = common.torch_contrastive_loss(text, image, scale)
    assert loss.device.type == "meta" and loss.shape == ()
    assert mode.seen == {"meta"}


def test_torch_contrastive_loss_on_cpu_is_the_symmetric_infonce():
    g = torch.Generator().manual_seed(0)
    text = torch.nn.functional.normalize(torch.randn(5, 4, generator=g), dim=1)
    image = torch.nn.functional.normalize(torch.randn(5, 4, generator=g), dim=1)
    scale = torch.tensor(2.0)
    logits = scale.exp() * text @ image.T
    t2i = -torch.log_softmax(logits, 1).diagonal().mean()
    i2t = -torch.log_softmax(logits.T, 1).diagonal().mean()
    assert torch.allclose(common.torch_contrastive_loss(text, image, scale), 0.5 * (t2i + i2t), atol=1e-6)


def test_parts_and_size_flags_override_either_modes_defaults():
    args = accelerator.parse_args(["--parts", "sr,train", "--batch", "32", "--train", "base,large", "--union", "7"])
    assert args.parts == ("sr", "train")
    on_gpu, on_cpu = accelerator.pick_sizes(args, True), accelerator.pick_sizes(args, False)
    assert (on_gpu.batch, on_gpu.train, on_gpu.union, on_gpu.cache_rows) == (32, ("base", "large"), 7, 4_000_000)
    assert (on_cpu.batch, on_cpu.train, on_cpu.union, on_cpu.cache_rows) == (32, ("base", "large"), 7, 20_000)
    tiny = accelerator.parse_args(["--tiny"])
    assert accelerator.pick_sizes(tiny, True) == accelerator.TINY and tiny.parts == accelerator.PARTS


def test_one_process_per_train_size_encoder_and_bart_dtype_in_the_order_of_parts():
    sizes = accelerator.pick_sizes(accelerator.parse_args(["--train", "base,large"]), True)
    assert accelerator.units(("bart", "train", "sr", "encode"), sizes) == [
        "bart:float32", "bart:bfloat16", "train:base", "train:large", "sr:cache", "encode:text", "encode:image"]


def test_an_unknown_part_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        accelerator.parse_args(["--parts", "sr,trian"])
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.endswith("--parts trian: choose from sr, train, encode, bart, serve")


def test_a_unit_past_its_time_limit_is_stopped_and_reported():
    t = time.perf_counter()
    # A unit gets at least 1 s; the tiny train step's unit takes ~10 s (the tiny SR's finished within 1 s).
    result, why = accelerator._spawn("train:tiny", accelerator.TINY, 0.5)
    assert result is None and why == "stopped at its time limit (0.5 s of the run's budget)"
    assert time.perf_counter() - t < 10


def test_the_whole_table_is_the_default_in_one_eight_minute_device_call():
    args = accelerator.parse_args([])
    assert args.parts == ("sr", "train", "encode", "bart", "serve") and not args.dry_run
    sizes = accelerator.pick_sizes(args, True)
    plan = accelerator.units(args.parts, sizes)
    assert plan == ["sr:cache", "train:base", "train:large", "encode:text", "encode:image", "bart:float32",
                    "bart:bfloat16", "serve:build", "serve:local", "serve:ray"]
    assert accelerator.default_budget(True) == 480  # one device call of 8 minutes
    share = accelerator.shares(plan, 480)
    assert abs(sum(share) - 480) < 1e-6 and share[plan.index("serve:build")] > share[plan.index("sr:cache")]
    # a unit gets its own share and what the units before it left; the later units' shares are kept for them
    assert accelerator.unit_limit(480, share[1:]) == pytest.approx(share[0])
    assert accelerator.unit_limit(480 - 1, share[2:]) == pytest.approx(480 - 1 - sum(share[2:]))
    served = accelerator.parse_args(["--parts", "serve", "--serve-rows", "5000", "--serve-c16", "4"])
    sizes = accelerator.pick_sizes(served, True)
    assert (sizes.serve_size, sizes.serve_rows, sizes.serve_c16, sizes.serve_words) == ("base", 5000, 4, 900)
    assert accelerator.units(served.parts, sizes) == ["serve:build", "serve:local", "serve:ray"]


def test_a_dry_runs_units_compute_on_two_cpu_devices():
    env = accelerator.unit_env(True)
    assert env["JAX_PLATFORMS"] == "cpu" and env["XLA_FLAGS"].endswith("--xla_force_host_platform_device_count=2")
    assert "--xla_force_host_platform_device_count" not in accelerator.unit_env(False).get("XLA_FLAGS", "")


def test_a_failed_unit_is_one_line_the_rest_run_and_the_run_exits_1(monkeypatch, tmp_path, capsys):
    """A part that fails (the served query's server dying at warm-up, say) prints one line, the next parts run, and
    the script exits 1 naming it: it exited 0 (`accelerator.sh --parts serve` met the device SR's warm-up crash)."""
    ran = []

    def spawn(unit, sizes, limit, scratch=None, extra=(), forced=False):
        ran.append((unit, forced))
        if unit == "probe:host":
            return {"accelerated": False, "backend": "cpu", "device_kind": "cpu", "hardware": "a CPU"}, ""
        if unit == "serve:local":
            return None, "failed (exit 1): CfirError: the server exited 1 before it was ready: AttributeError: x"
        return [{"what": f"{unit} row", "unit": unit}], ""

    monkeypatch.setattr(accelerator, "_spawn", spawn)
    monkeypatch.setattr("sys.argv", ["accelerator.py", "--parts", "sr,serve", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        accelerator.main()
    assert e.value.code == 1
    assert [u for u, _ in ran] == ["probe:host", "sr:cache", "serve:build", "serve:local", "serve:ray"]
    assert all(forced for _, forced in ran[1:])  # no accelerator here: the dry run, device branches forced
    out, err = capsys.readouterr()
    failed = [line for line in out.splitlines() if line.startswith("serve:local")]
    assert len(failed) == 1 and failed[0].startswith("serve:local: failed (exit 1): CfirError: the server exited 1")
    assert any(line.startswith("serve:ray: done in ") for line in out.splitlines())
    assert err.strip().splitlines()[-1] == "accelerator.sh: 1 of 4 units failed or were stopped: serve:local"
    assert json.loads((tmp_path / "accelerator.json").read_text())["failed"] == ["serve:local"]


def test_the_stage_split_is_each_stages_mean_ms_between_two_reads_of_the_services_metrics():
    from prometheus_client import generate_latest

    from cfir_jax.serve.metrics import Metrics

    metrics = Metrics()
    metrics.observe_stages({"entities": 50.0, "summary": 900.0, "encode": 20.0, "er": 4.0, "score": 1.0})
    before = accelerator_serve.parse_stage_totals(generate_latest(metrics.registry).decode())
    for doc in range(2):  # two more documents: the split is their mean, not the first one's
        metrics.observe_stages({"entities": 10.0 + doc, "summary": 300.0, "encode": 8.0, "er": 2.0, "score": 0.5})
    after = accelerator_serve.parse_stage_totals(generate_latest(metrics.registry).decode())
    split = accelerator_serve.stage_split(before, after)
    assert list(split) == ["spaCy", "BART", "tower", "ER", "SR"]
    assert [round(ms, 6) for ms in split.values()] == [10.5, 300.0, 8.0, 2.0, 0.5]
    assert accelerator_serve.stage_split({}, accelerator_serve.parse_stage_totals("cfir_requests_total 3.0\n")) == {}


def test_on_an_accelerator_the_run_measures_at_full_size_unforced_and_serves_on_the_gpu(monkeypatch, tmp_path):
    """The probe names a GPU (faked: this host has none): full sizes, the 8-minute budget, no unit forced onto the
    CPU, the servers told they hold an accelerator (Ray's front takes the GPU); --dry-run still forces the CPU."""
    calls = []

    def spawn(unit, sizes, limit, scratch=None, extra=(), forced=False):
        calls.append((unit, sizes, limit, extra, forced))
        if unit == "probe:host":
            return {"accelerated": True, "backend": "gpu", "device_kind": "NVIDIA H100 80GB HBM3",
                    "hardware": "a GPU"}, ""
        return [{"what": f"{unit} row", "unit": unit}], ""

    monkeypatch.setattr(accelerator, "_spawn", spawn)
    result = accelerator.drive(accelerator.parse_args(["--parts", "sr,serve", "--realsize", str(tmp_path)]))
    assert result["mode"] == "accelerator measurements on NVIDIA H100 80GB HBM3 (gpu)"
    assert result["accelerator"] and not result["dry_run"] and result["budget_s"] == 480
    units = calls[1:]
    assert [u for u, *_ in units] == ["sr:cache", "serve:build", "serve:local", "serve:ray"]
    assert all(sizes == accelerator.FULL and not forced for _, sizes, _, _, forced in units)
    assert all("--accelerated" in extra for u, _, _, extra, _ in units if u.startswith("serve:"))
    assert sum(limit for _, _, limit, _, _ in units[:1]) < 480
    calls.clear()
    dry = accelerator.drive(accelerator.parse_args(["--parts", "sr", "--dry-run"]))
    assert dry["dry_run"] and not dry["accelerator"] and dry["mode"].startswith("the dry run")
    assert all(forced and sizes in (None, accelerator.TINY) for _, sizes, _, _, forced in calls)


def test_the_script_says_when_nvidia_smi_sees_a_gpu_that_jax_does_not(tmp_path):
    """A GPU host whose jax has no CUDA plugin (faked: an nvidia-smi that answers, and this CPU jax)."""
    import os
    import subprocess
    import sys

    from repo import ROOT

    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", PYTHON=sys.executable, JAX_PLATFORMS="cpu")
    out = subprocess.run(["bash", "benchmarks/accelerator.sh", "--parts", "nothing"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert "accelerator.sh: nvidia-smi sees a GPU but jax does not: pip install -e '.[cuda]'" in out.stderr
    assert out.returncode == 2  # then the unknown part, one line
