"""Training throughput of the trainer's own step vs torchscale, and the compiled memory of the step at batch 512.

    python benchmarks/train_throughput.py                    # base: examples/s vs torch, then memory of base/large
    python benchmarks/train_throughput.py --size tiny --steps 3 --memory-sizes ""   # smoke run, no memory part
    python benchmarks/train_throughput.py --steps 0          # memory analysis only
    python benchmarks/train_throughput.py --step full        # D-BEiT-3 Full step (both towers, 224 px) vs torch

Throughput: `make_setup` / `init_state` / `make_train_step` with the size's config (`configs/<size>.py`: the
recipe's weight decay mask, layer-wise lr decay, warmup-cosine AdamW; residual dropout 0.1 in place of its drop path
on both sides, as torchscale's drop path is fixed when the reference model is built) and a `TrainData` of random
tokens and random unit image embeddings, batches assembled by `global_batch_arrays` each step as the training loop
does; the reference is torchscale with the same trainable set (the B experts, language head, temperature), the same
dropout on the layers' residual branches and torch.optim.AdamW. The two run interleaved in one process: compare the
ratio.

Memory: the step is lowered ahead of time from `jax.ShapeDtypeStruct`s that carry the shardings (`Setup.
abstract_state`, the frozen table, the batch), so nothing is allocated, at global batch `--memory-batch` (512, the
paper's) over the config's mesh. By default this runs in a child process with `--memory-devices` (8) fake host
devices (`XLA_FLAGS=--xla_force_host_platform_device_count`), so the sizes printed are per device of an 8-way mesh:
base replicates its parameters over 8-way data parallelism, large shards every parameter over fsdp=8.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import common  # noqa: E402,F401  (puts the repository root on sys.path for `configs`)

GIB = 1024**3


def _config(size: str, batch: int, seq: int, dtype: str, remat: bool | None, full: bool = False):
    """The size's shipped config (tiny = `configs/base.py:runlocal`; `full`: its `:full` variant) at this batch,
    sequence length and dtype."""
    from configs import base, large

    arg = ",".join(([] if size != "tiny" else ["runlocal"]) + (["full"] if full else [])) or None
    cfg = (large if size == "large" else base).get_config(arg)
    cfg.train.global_batch = batch
    cfg.train.max_text_len = seq
    cfg.model.dtype = dtype
    cfg.model.update(dropout=0.1, drop_path_rate=0.0)  # what torch_model can mirror (see the module docstring)
    if remat is not None:
        cfg.model.remat = remat
    return cfg


def random_train_data(num_pairs: int, seq: int, vocab: int, dim: int, seed: int = 0):
    """A `TrainData` of `num_pairs` random token sequences, each paired with its own random unit embedding."""
    import numpy as np
    from common import random_text_batch, random_unit_embeddings

    from cfir_jax.training.data import TrainData

    ids, mask = random_text_batch(num_pairs, seq, vocab, seed)
    images = random_unit_embeddings(num_pairs, dim, seed + 1)
    return TrainData(ids, mask, np.arange(num_pairs), np.arange(num_pairs), images)


def throughput(args) -> None:
    import jax
    from common import hardware_description, interleaved, torch_model, torch_train_step

    from cfir_jax.training.state import init_state, make_setup
    from cfir_jax.training.step import global_batch_arrays, make_train_step

    dtype = "bfloat16" if args.precision == "bf16" else "float32"
    cfg = _config(args.size, args.batch, args.seq, dtype, args.remat)
    data = random_train_data(4 * args.batch, args.seq, cfg.model.vocab_size, cfg.model.embed_dim)
    total = args.warmup + args.steps + 1
    # One real device: XLA:CPU already spreads each op over all cores, as torch does with its threads.
    setup = make_setup(cfg, total, jax.devices()[:1], data.steps_per_epoch(cfg.train.global_batch))
    state, frozen = init_state(cfg, setup, None)
    step_fn = make_train_step(cfg, setup)
    t = time.perf_counter()
    step_fn = step_fn.lower(state, frozen, global_batch_arrays(data, 0, cfg, setup.mesh)).compile()
    compile_s = time.perf_counter() - t
    holder = {"state": state, "step": 0}

    def jax_step() -> float:
        batch = global_batch_arrays(data, holder["step"], cfg, setup.mesh)
        holder["state"], metrics = step_fn(holder["state"], frozen, batch)
        holder["step"] += 1
        return float(metrics["loss"])  # blocks until the step is done

    runners = {"jax": jax_step}
    if not args.no_torch:
        t_model, t_trainable = torch_model(cfg.model, dropout=cfg.model.dropout)
        rows = data.batch_rows(0, args.batch, cfg.train.seed)
        runners["torch"] = torch_train_step(t_model, t_trainable, data.ids[rows], data.padding_mask[rows],
                                            data.image_embeddings[rows], args.precision == "bf16",
                                            lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    print(hardware_description())
    print(f"train step, size {args.size} ({args.precision}, dropout {cfg.model.dropout}, scan_layers="
          f"{cfg.model.scan_layers}, remat={cfg.model.remat}), global batch {args.batch} x {args.seq} tokens; "
          f"jax compile {compile_s:.1f}s; median of {args.steps} interleaved steps after {args.warmup} warmup")
    _report(f"[{args.precision}] trainer step", interleaved(runners, args.steps, args.warmup), args.batch, "ex")


def _report(label: str, timings: dict, items: int, unit: str) -> None:
    """The jax/torch ratio line, or jax's rate alone under --no-torch."""
    from common import ratio_line

    if "torch" in timings:
        print(ratio_line(label, timings["jax"], timings["torch"], items, unit))
    else:
        j = timings["jax"]
        print(f"{label:<34} jax {items / j.median:8.1f} {unit}/s [{j.spread()}]")


def full_throughput(args) -> None:
    """The D-BEiT-3 Full step (`make_full_step`: both towers from uint8 pixels) against torchscale's whole-model
    step on the same batch shapes, interleaved."""
    import jax
    import numpy as np
    from common import hardware_description, interleaved, random_text_batch, torch_full_step, torch_model

    from cfir_jax.training.full_step import global_full_batch, make_full_step
    from cfir_jax.training.state import init_state, make_setup

    dtype = "bfloat16" if args.precision == "bf16" else "float32"
    cfg = _config(args.size, args.batch, args.seq, dtype, args.remat, full=True)
    if args.image_size:
        cfg.model.image_size = args.image_size
    size, n = cfg.model.image_size, 4 * args.batch
    ids, mask = random_text_batch(n, args.seq, cfg.model.vocab_size, 0)
    pixels = np.random.default_rng(1).integers(0, 256, size=(n, size, size, 3), dtype=np.uint8)
    total = args.warmup + args.steps + 1
    setup = make_setup(cfg, total, jax.devices()[:1], 4, tower="dual")
    state, frozen = init_state(cfg, setup, None)
    step_fn = make_full_step(cfg, setup)

    def batch(step: int) -> dict:
        """The step-th of 4 batches, assembled from host arrays as the Full trainer does with the pipeline's."""
        rows = np.arange(args.batch) + (step % 4) * args.batch
        local = {"pixels": pixels[rows], "doc_rows": rows, "valid": np.ones(args.batch, bool)}
        return global_full_batch(local, ids, mask, setup.mesh)

    t = time.perf_counter()
    step_fn = step_fn.lower(state, frozen, batch(0)).compile()
    compile_s = time.perf_counter() - t
    holder = {"state": state, "step": 0}

    def jax_step() -> float:
        holder["state"], metrics = step_fn(holder["state"], frozen, batch(holder["step"]))
        holder["step"] += 1
        return float(metrics["loss"])  # blocks until the step is done

    runners = {"jax": jax_step}
    j_params = sum(x.size for x in jax.tree.leaves(state["params"]))
    if not args.no_torch:
        t_model, t_trainable = torch_model(cfg.model, dropout=cfg.model.dropout, full=True)
        rows = np.arange(args.batch)
        runners["torch"] = torch_full_step(t_model, t_trainable, pixels[rows], ids[rows], mask[rows],
                                           args.precision == "bf16", lr=cfg.train.lr,
                                           weight_decay=cfg.train.weight_decay)
        t_params = sum(p.numel() for p in t_trainable)
        if t_params != j_params:
            raise SystemExit(f"trained parameters differ: jax {j_params:,}, torch {t_params:,}")
    print(hardware_description())
    print(f"D-BEiT-3 Full step, size {args.size} ({args.precision}, {size} px, dropout {cfg.model.dropout}, "
          f"remat={cfg.model.remat}), global batch {args.batch} pairs (images + {args.seq}-token texts), "
          f"{j_params:,} trained parameters; jax compile "
          f"{compile_s:.1f}s; median of {args.steps} interleaved steps after {args.warmup} warmup")
    _report(f"[{args.precision}] Full step", interleaved(runners, args.steps, args.warmup), args.batch, "pairs")


def memory(args) -> None:
    """Per-device sizes of the AOT-compiled train step for each size at the memory batch, on this process' devices."""
    import jax

    from cfir_jax.training import partition
    from cfir_jax.training.state import make_setup
    from cfir_jax.training.step import make_train_step

    print(f"compiled train step memory per device, global batch {args.memory_batch} x {args.seq} tokens, "
          f"{jax.device_count()} {jax.devices()[0].platform} devices (AOT from ShapeDtypeStructs, nothing allocated)")
    print(f"{'size':<6} {'mesh':<18} {'dtype':<9} {'remat':<6} {'args GiB':>9} {'out GiB':>8} {'alias GiB':>9} "
          f"{'temp GiB':>9} {'total GiB':>9} {'compile s':>9}")
    for size in [s for s in args.memory_sizes.split(",") if s]:
        dtype = "bfloat16" if args.precision == "bf16" else "float32"
        cfg = _config(size, args.memory_batch, args.seq, dtype, args.remat)
        setup = make_setup(cfg, 1000, steps_per_epoch=100)  # the schedule does not change memory
        step = make_train_step(cfg, setup)
        frozen = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                              setup.abstract_frozen, setup.frozen_shardings)
        bsh = partition.batch_sharding(setup.mesh)
        b, L, d = args.memory_batch, args.seq, cfg.model.embed_dim
        batch = {"ids": jax.ShapeDtypeStruct((b, L), jax.numpy.int32, sharding=bsh),
                 "mask": jax.ShapeDtypeStruct((b, L), jax.numpy.bool_, sharding=bsh),
                 "image": jax.ShapeDtypeStruct((b, d), jax.numpy.float32, sharding=bsh)}
        t = time.perf_counter()
        compiled = step.lower(setup.abstract_state, frozen, batch).compile()
        compile_s = time.perf_counter() - t
        m = compiled.memory_analysis()
        mesh = f"data={setup.mesh.shape['data']},fsdp={setup.mesh.shape['fsdp']}"
        # Donated state aliases its output: the live peak is args + out - alias + temp.
        total = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
        print(f"{size:<6} {mesh:<18} {dtype:<9} {str(cfg.model.remat):<6} {m.argument_size_in_bytes / GIB:9.3f} "
              f"{m.output_size_in_bytes / GIB:8.3f} {m.alias_size_in_bytes / GIB:9.3f} "
              f"{m.temp_size_in_bytes / GIB:9.3f} {total / GIB:9.3f} {compile_s:9.1f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--step", choices=("text", "full"), default="text",
                   help="text: CFIR's language-expert step against cached image embeddings; full: the D-BEiT-3 Full "
                        "step, both towers from pixels (its memory is in benchmarks/tpu_compile_table.py --only full)")
    p.add_argument("--size", choices=("tiny", "base", "large"), default="base", help="throughput model size")
    p.add_argument("--batch", type=int, default=None, help="global batch of the throughput run (text 32, full 8)")
    p.add_argument("--image-size", type=int, default=None, help="full: override the config's image size (224)")
    p.add_argument("--seq", type=int, default=64, help="tokens per text (the config's max_text_len)")
    p.add_argument("--steps", type=int, default=5, help="timed steps of each side; 0 skips the throughput part")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--remat", action=argparse.BooleanOptionalAction, default=None,
                   help="override the config's per-layer rematerialisation")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--memory-sizes", default="base,large", help="comma-separated sizes for the memory part")
    p.add_argument("--memory-batch", type=int, default=512)
    p.add_argument("--memory-devices", type=int, default=8,
                   help="fake host devices of the memory child process; 0: this process' own devices")
    p.add_argument("--memory-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.memory_only:
        memory(args)
        return
    if args.batch is None:
        args.batch = 8 if args.step == "full" else 32
    if args.step == "full":
        if args.steps > 0:
            full_throughput(args)
        return
    if args.steps > 0:
        throughput(args)
    if not args.memory_sizes:
        return
    if args.memory_devices <= 0:
        memory(args)
        return
    # The device count is fixed when jax initialises its backend, so the 8-device mesh needs a fresh process.
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={args.memory_devices}").strip()
    argv = [sys.executable, os.path.abspath(__file__), "--memory-only", "--memory-sizes", args.memory_sizes,
            "--memory-batch", str(args.memory_batch), "--seq", str(args.seq), "--precision", args.precision]
    if args.remat is not None:
        argv.append("--remat" if args.remat else "--no-remat")
    sys.stdout.flush()
    subprocess.run(argv, env=env, check=True)


if __name__ == "__main__":
    main()
