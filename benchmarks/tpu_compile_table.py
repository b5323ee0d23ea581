"""The README's "Compiled for TPUs" table: every accelerator program compiled (not run) for real TPU topologies.

    flock /tmp/cfir-bench.lock python benchmarks/tpu_compile_table.py --out benchmarks/tpu_compile_table.md
    flock /tmp/cfir-bench.lock python benchmarks/tpu_compile_table.py --only full \
        --out benchmarks/tpu_compile_table_full.md --json benchmarks/tpu_compile_table_full.json

Rows: CFIR-B and CFIR-L train steps at the configs' global batch 512 and at the largest batch that fits, on v4-8,
v5e-16, v5p-64 (4x4x4) and v6e-8; the vision tower's image-cache encoding step at 224 and 384 px; the exact entity
top-K and the device SR over AToMiC-sized caches (4M x 768 base, 11,019,202 x 1024 large, bfloat16, row-sharded
over one v5e-8 / v6e-8 host). The largest batch is found cheaply: the batch-512 compile gives the memory that does
not grow with the batch (arguments, outputs) and the temporaries per sequence; the estimate, rounded down to a
multiple of 256, is confirmed by one compile (if it does not fit, the estimate is redone from that compile's own
temporaries, at most twice). Each row is appended to `--out` (markdown) and `--json` as it finishes.

`--only bart --out benchmarks/tpu_compile_table_bart.md --json benchmarks/tpu_compile_table_bart.json`: BART-large-CNN's
generation (CFIR's 4-beam search, 1,024 input tokens, float32 and bfloat16 compute) per host of v5e-8, v6e-8 and
v5p-64, for query batches of 1, 8 and 64 documents and the index's batch (index.summaries.batch_size rows per device;
a shape already compiled as a query batch is not compiled twice).

`--only train --configs base --no-largest --append`: the base train step's batch-512 rows again (after a change of
its config), added below the others in both files.

`--only full`: the D-BEiT-3 Full step (both towers from 224 px pixels; configs/base.py:full and large.py:full) on
the same four slices at batch 512, then the largest batch of each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from cfir_jax.aot import programs as programs_lib  # noqa: E402
from cfir_jax.aot.compile import GIB, compile_program  # noqa: E402
from cfir_jax.aot.topology import resolve  # noqa: E402
from cfir_jax.core.cli import load_config_file  # noqa: E402

TRAIN_TOPOLOGIES = ("v4-8", "v5e-16", "v5p-64", "v6e-8")
HOST_TOPOLOGIES = ("v5e-8", "v6e-8")
STEP = 256
HEAD = ("| program | config | topology | per-device GiB: args / out / temps / **total** of HBM | fits | compile s "
        "| shapes |\n|---|---|---|---|---|---|---|")


def md_row(r, config_name: str, topology) -> str:
    mem = (f"{r.arguments / GIB:.2f} / {(r.outputs - r.aliased) / GIB:.2f} / {r.temporaries / GIB:.2f} / "
           f"**{r.total / GIB:.2f}** of {r.hbm / GIB:.0f}")
    return (f"| {r.program} | {config_name} | {topology.name} ({topology.chips} chips, {topology.hosts} host"
            f"{'s' if topology.hosts > 1 else ''}) | {mem} | {'yes' if r.fits else 'no'} | {r.compile_s:.0f} | "
            f"{r.shapes} |")


def largest_batch(config, topology, first, builder=programs_lib.train_step) -> tuple[object, str]:
    """(result at the largest multiple of STEP found to fit, how it was found) from the batch-512 result of
    `builder`'s first program (the text train step, or the Full step)."""
    b0, last = int(config.train.global_batch), first
    tries = []
    for _ in range(3):
        b_last = int(last.shapes.split()[1])
        fixed = last.total - last.temporaries
        per_seq = last.temporaries / b_last
        guess = int((last.hbm * 0.98 - fixed) / per_seq) // STEP * STEP
        if tries and not tries[-1][1].fits:
            guess = min(guess, (tries[-1][0] - STEP) // STEP * STEP)
        if guess < STEP or guess in [b for b, _ in tries]:
            break
        result = compile_program(builder(config, topology, guess)[0], topology)
        tries.append((guess, result))
        if result.fits:
            break
        last = result
    fitting = [(b, r) for b, r in tries if r.fits]
    how = (f"linear estimate from batch {b0}, then " + ", ".join(f"{b} {'fits' if r.fits else 'does not fit'}"
                                                                  for b, r in tries))
    if not fitting:
        return None, how + "; none fits"
    return fitting[-1][1], how


BART_TOPOLOGIES = ("v5e-8", "v6e-8", "v5p-64")


def bart_rows(configs, only, emit) -> None:
    """BART's generation rows, float32 first on every slice (the paper's), then bfloat16; one compile per shape."""
    if "bart" not in only:
        return
    config, done = configs.get("base") or next(iter(configs.values())), {}
    for dtype in programs_lib.BART_DTYPES:
        for topo_name in BART_TOPOLOGIES:
            topology = resolve(topo_name)
            programs = (programs_lib.bart_queries(config, topology, dtypes=(dtype,))
                        + programs_lib.bart_index(config, topology, dtypes=(dtype,)))
            for program in programs:
                key = (topo_name, dtype, program.args[1].shape)
                if key in done:
                    print(f"{program.name} on {topo_name}: the shape of {done[key]}, compiled above", flush=True)
                    continue
                done[key] = program.name
                emit(compile_program(program, topology), "base (BART-large-CNN)", topology)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/tpu_compile_table.md")
    parser.add_argument("--json", default="benchmarks/tpu_compile_table.json")
    parser.add_argument("--only", default="", help="comma-separated subset of: train, image, entity, sr, full, bart")
    parser.add_argument("--configs", default="base,large", help="comma-separated subset of: base, large")
    parser.add_argument("--no-largest", action="store_true", help="only the batch-512 rows of the train steps")
    parser.add_argument("--append", action="store_true", help="add the rows to --out and --json (regenerating "
                        "some rows beside the others)")
    args = parser.parse_args()
    only = set(filter(None, args.only.split(","))) or {"train", "image", "entity", "sr"}
    out = Path(args.out)
    rows = json.loads(Path(args.json).read_text()) if args.append else []
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    started = (f"Load before: `{uptime}`; {os.cpu_count()} CPU cores; "
               f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    if args.append:
        with out.open("a") as f:
            f.write(f"\nRows added: {started}\n\n{HEAD}\n")
    else:
        out.write_text(f"{started}\n\n{HEAD}\n")

    def emit(result, config_name, topology, extra=""):
        with out.open("a") as f:
            f.write(md_row(result, config_name, topology).replace(f" | {result.shapes} |",
                                                                  f" | {result.shapes}{extra} |") + "\n")
        rows.append({"config": config_name, "topology": topology.name, "chips": topology.chips,
                     "hosts": topology.hosts, "program": result.program, "shapes": result.shapes + extra,
                     "arguments": result.arguments, "outputs": result.outputs, "aliased": result.aliased,
                     "temporaries": result.temporaries, "total": result.total, "hbm": result.hbm,
                     "fits": result.fits, "compile_s": round(result.compile_s, 1)})
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
        print(md_row(result, config_name, topology), flush=True)

    configs = {name: load_config_file(f"configs/{name}.py") for name in args.configs.split(",")}
    full_configs = {f"{name}:full": load_config_file(f"configs/{name}.py:full") for name in configs}
    # Cheapest and most telling rows first (the batch-512 steps, then the per-host programs), the largest-batch
    # searches last, so an interrupted run still has a useful table.
    firsts = {}
    for group, builder, group_configs in (("train", programs_lib.train_step, configs),
                                          ("full", programs_lib.train_full, full_configs)):
        if group not in only:
            continue
        for name, config in group_configs.items():
            for topo_name in TRAIN_TOPOLOGIES:
                topology = resolve(topo_name)
                first = compile_program(builder(config, topology)[0], topology)
                firsts[name, topo_name] = first, builder, config
                emit(first, name, topology)
    if "image" in only:
        topology = resolve("v5e-8")
        for size in (224, 384):
            name = "large" if "large" in configs else "base"
            emit(compile_program(programs_lib.image_encoding(configs[name], topology, size)[0], topology),
                 name, topology)
    for name in configs:
        rows_n = programs_lib.CACHE_ROWS[name]
        for topo_name in HOST_TOPOLOGIES:
            topology = resolve(topo_name)
            if "entity" in only and topo_name == "v5e-8":
                emit(compile_program(programs_lib.entity_topk(configs[name], topology, rows_n, "bfloat16")[0],
                                     topology), name, topology)
            if "sr" in only:
                for program in programs_lib.device_sr(configs[name], topology, rows_n, "bfloat16"):
                    emit(compile_program(program, topology), name, topology)
    bart_rows(configs, only, emit)
    for (name, topo_name), (first, builder, config) in ({} if args.no_largest else firsts).items():
        topology = resolve(topo_name)
        best, how = largest_batch(config, topology, first, builder)
        if best is not None:
            emit(best, name, topology, f" (largest: {how})")
        else:
            with out.open("a") as f:
                f.write(f"| {first.program} largest batch | {name} | {topology.name} | - | - | - | {how} |\n")
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    with out.open("a") as f:
        f.write(f"\nLoad after: `{uptime}`\n")


if __name__ == "__main__":
    main()
