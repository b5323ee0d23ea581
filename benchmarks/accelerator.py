"""Every accelerator measurement in one run (`bash benchmarks/accelerator.sh`): train step vs torchscale on the same
device, text and image encoding throughput, device SR ms/query, BART summaries/s and a lone document's summary, peak
device memory of each, and the served query at real size (single process, and Ray with 1 shard).

  bash benchmarks/accelerator.sh [--parts sr,train,encode,bart,serve] [--batch 512 --steps 5 ...] [--out DIR]
  bash benchmarks/accelerator.sh --dry-run          # the same units at tiny sizes on the CPU, device branches forced

Each measured unit runs in its own process (SR; the train step of each size; text and image encoding; BART in each
dtype; the served query's build and each engine), so each unit's peak device memory is its own: XLA's
peak_bytes_in_use is the high-water mark of the process and cannot be reset, so in one process every row after the
largest one repeats its peak. The run keeps to --budget seconds (480 on an accelerator: one 8-minute device call):
each unit gets its share (`SHARES_S`, scaled to the budget) plus what the units before it left unspent, and a unit
past that is stopped. A unit that fails or is stopped prints one line and the next one runs; the run then exits 1,
naming them. Each unit's time is printed as it ends.

`--dry-run` (what runs on a host without an accelerator, and in the test suite) runs the same units at tiny sizes on
the CPU with every device branch forced: two CPU devices per unit (XLA_FLAGS=--xla_force_host_platform_device_count=2:
the train step's mesh, the image tower's and BART's batch split over devices), the SR cache sharded over them, BART's
rows sized to a device's free memory (a fixed figure stands for the memory the CPU does not report), and the served
query with SR on the device (retrieval.sr_backend=device, sr_device_shard=always), which a GPU's "auto" picks.

On a GPU (or TPU) host: base and large train steps in bfloat16 at batch --batch (torchscale's step on the same GPU,
interleaved, ratio printed), encoders at batch 256, device SR over a 4M x 768 float16 cache with ~60k-row unions
(one query per call and 64 per call) beside the paper's 4.7 ms, BART-large-CNN summaries/s. On a host without an
accelerator it says so and runs the dry run (its figures are not accelerator figures). Any size flag overrides the
default of either mode. Writes --out/accelerator.json and --out/accelerator.md.

The serve part builds or reuses a real-size workdir in --realsize (default ~/realsize/base on an accelerator; at
tiny sizes the run's scratch folder; 10 GB at base size) and serves it: the single process, then Ray with 1 shard,
each with SR on the device; p50 at concurrency 1, documents/s at concurrency 16 and the per-stage split
(benchmarks/accelerator_serve.py). A build cut short is completed by the next run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import accelerator_serve
import accelerator_units
import common  # noqa: F401  (puts the repository root on sys.path)
from accelerator_units import FULL, TINY, Sizes

PARTS = ("sr", "train", "encode", "bart", "serve")
DEFAULT_PARTS = PARTS  # the whole table in one run
BUDGET_S = {True: 480.0, False: 2100.0}  # the run: on an accelerator (one 8-minute call); the dry run on 2 CPU cores
# Each unit's share of the budget on an accelerator (seconds; scaled to the budget): the serve part's build writes a
# 4M x 768 cache and two random BARTs, and each server compiles BART-large-CNN's beam search before it is ready.
SHARES_S = {"sr": 25.0, "train": 40.0, "encode": 15.0, "bart": 35.0, "serve:build": 110.0, "serve:local": 60.0,
            "serve:ray": 70.0}
DRY_RUN_DEVICES = 2  # CPU devices per unit of the dry run: every multi-device branch runs
SIZE_HELP = {"train": "train step sizes, comma-separated (base, large, tiny)", "batch": "train step global batch",
             "steps": "timed steps (and encoder calls) after the warmup", "encode_batch": "encoding batch",
             "cache_rows": "device SR cache rows", "cache_dim": "device SR cache dims", "union": "SR union rows",
             "sr_queries": "SR queries (and queries per batched call)",
             "bart": "BART shape: facebook/bart-large-cnn (random weights) or tiny", "bart_docs": "BART documents",
             "serve_size": "served workdir: realsize.py's size (base, large, tiny)", "serve_rows": "its cache rows",
             "serve_words": "served documents lengthened to this many words (0: as they are)",
             "serve_c1": "requests at concurrency 1", "serve_c16": "requests at concurrency 16"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/accelerator_results")
    parser.add_argument("--parts", default=",".join(DEFAULT_PARTS), help=f"comma-separated subset of "
                        f"{', '.join(PARTS)} (default {','.join(DEFAULT_PARTS)})")
    parser.add_argument("--realsize", default=None, help="serve: the real-size workdir's folder, built or reused "
                        "(default ~/realsize/SIZE on an accelerator, the run's scratch folder at tiny sizes)")
    parser.add_argument("--world", default=None, help="serve: copy this indexed synthetic workdir into a new "
                        "real-size folder instead of indexing one (realsize.py build --world)")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes even on an accelerator (a smoke run)")
    parser.add_argument("--dry-run", action="store_true", help="the same units at tiny sizes on the CPU, every "
                        "device branch forced (2 CPU devices per unit, the SR cache sharded, SR served on the "
                        "device): what a host without an accelerator runs, and the test suite")
    parser.add_argument("--budget", type=float, default=None, help="seconds for the whole run (480 on an "
                        "accelerator, 2100 for the dry run)")
    for field in dataclasses.fields(Sizes):
        kind = int if field.type == "int" else str
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=kind, default=None, help=SIZE_HELP[field.name])
    parser.add_argument("--unit", help=argparse.SUPPRESS)  # a worker process: measure one unit
    parser.add_argument("--sizes-json", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    parser.add_argument("--accelerated", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--forced", action="store_true", help=argparse.SUPPRESS)  # a dry run's unit
    args = parser.parse_args(argv)
    args.parts = tuple(p for p in args.parts.split(",") if p)
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown or not args.parts:
        parser.error(f"--parts {','.join(unknown) or '(none)'}: choose from {', '.join(PARTS)}")
    return args


def pick_sizes(args: argparse.Namespace, accelerated: bool) -> Sizes:
    """The defaults of the mode (FULL on an accelerator unless --tiny, else TINY), then each size flag given."""
    sizes = dataclasses.replace(FULL if accelerated and not args.tiny else TINY)
    for field in dataclasses.fields(Sizes):
        value = getattr(args, field.name)
        if value is not None:
            setattr(sizes, field.name, tuple(value.split(",")) if field.name == "train" else value)
    return sizes


def units(parts: tuple[str, ...], sizes: Sizes) -> list[str]:
    """The processes of a run, in the order of --parts: 'part:which' (one per train size, per encoder, per dtype)."""
    out = []
    for part in parts:
        which = {"sr": ("cache",), "train": sizes.train, "encode": ("text", "image"),
                 "bart": ("float32", "bfloat16"), "serve": ("build", "local", "ray")}[part]
        out += [f"{part}:{w}" for w in which]
    return out


def default_budget(full: bool) -> float:
    """Seconds for the run: one 8-minute device call on an accelerator, the dry run's on the CPU."""
    return BUDGET_S[full]


def shares(plan: list[str], budget: float) -> list[float]:
    """Each unit's share of the budget: SHARES_S (by unit, else by part) scaled so that the shares fill it."""
    raw = [SHARES_S[unit] if unit in SHARES_S else SHARES_S[unit.split(":")[0]] for unit in plan]
    return [budget * r / sum(raw) for r in raw]


def unit_limit(budget_left: float, later: list[float]) -> float:
    """A unit's time limit: what is left of the budget less the shares of the units after it (so it gets its own
    share and whatever the units before it left unspent)."""
    return budget_left - sum(later)


# --------------------------------------------------------------------------------------------------------- driver


def unit_env(forced: bool) -> dict:
    """A unit's environment: jax allocates as it goes (torchscale's step shares the GPU in the train units, and
    nothing is held back); a dry run's unit computes on 2 CPU devices."""
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if forced:
        flags = env.get("XLA_FLAGS", "")
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={DRY_RUN_DEVICES}"
                   .strip())
    return env


def _spawn(unit: str, sizes: Sizes | None, limit: float, scratch: str | None = None,
           extra: tuple[str, ...] = (), forced: bool = False) -> tuple[object, str]:
    """Runs one unit in a fresh process group within `limit` seconds: (its result, or None, and a one-line reason).
    Past the limit the group is sent SIGTERM (a server the unit started stops itself, and the Ray it started),
    then SIGKILL 30 s later."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp, "result.json")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--unit", unit, "--result", str(result), *extra]
        if sizes is not None:
            cmd += ["--sizes-json", json.dumps(dataclasses.asdict(sizes))]
        if scratch is not None:
            cmd += ["--scratch", scratch]
        cmd += ["--forced"] if forced else []
        proc = subprocess.Popen(cmd, env=unit_env(forced), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=max(limit, 1.0))
        except subprocess.TimeoutExpired:
            for sig, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, None)):
                try:
                    os.killpg(proc.pid, sig)
                    proc.communicate(timeout=wait)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
            return None, f"stopped at its time limit ({limit:g} s of the run's budget)"
        if proc.returncode != 0 or not result.exists():
            tail = out.strip().splitlines()[-1:] or ["no output"]
            return None, f"failed (exit {proc.returncode}): {tail[0][:300]}"
        return json.loads(result.read_text()), ""


def drive(args: argparse.Namespace) -> dict:
    start = time.perf_counter()
    found, why = _spawn("probe:host", None, 120.0, forced=args.dry_run)
    if found is None:
        raise SystemExit(f"accelerator.py: the probe of this host's jax {why}")
    accelerated = found["accelerated"]
    forced = args.dry_run or not accelerated  # a host without an accelerator runs the dry run
    sizes = pick_sizes(args, accelerated and not forced)
    full = accelerated and not args.tiny and not forced
    budget = args.budget or default_budget(full)
    if full:
        mode = f"accelerator measurements on {found['device_kind']} ({found['backend']})"
    elif forced:
        mode = ("" if accelerated else "no accelerator on this host (jax backend: cpu): ") + \
            (f"the dry run: tiny sizes on {DRY_RUN_DEVICES} CPU devices, every device branch forced; these figures "
             "are NOT accelerator figures")
    else:
        mode = "tiny smoke run (--tiny) on the accelerator"
    print(mode, flush=True)
    plan, rows, failed = units(args.parts, sizes), [], []
    share = shares(plan, budget)
    scratch = tempfile.TemporaryDirectory(prefix="accelerator-")  # what units share (BART's model directory)
    serve = serve_args(args, sizes, full, accelerated and not forced, scratch.name)
    for i, unit in enumerate(plan):
        t = time.perf_counter()
        limit = unit_limit(budget - (t - start), share[i + 1:])
        extra = serve if unit.startswith("serve:") else ()
        got, why = (_spawn(unit, sizes, limit, scratch.name, extra, forced) if limit > 1
                    else (None, "not run: the run's budget was spent"))
        rows += got if got is not None else [{"what": f"{unit}: {why}", "unit": unit}]
        failed += [unit] if got is None else []
        print(f"{unit}: {why or 'done'} in {time.perf_counter() - t:.0f} s (total {time.perf_counter() - start:.0f} "
              "s)", flush=True)
    scratch.cleanup()
    return {"mode": mode, "accelerator": full, "dry_run": forced, "hardware": found["hardware"],
            "parts": list(args.parts), "sizes": dataclasses.asdict(sizes), "budget_s": budget, "rows": rows,
            "units": plan, "failed": failed, "seconds": time.perf_counter() - start}


def serve_args(args: argparse.Namespace, sizes: Sizes, full: bool, accelerated: bool, scratch: str) -> tuple:
    """The serve units' flags: the real-size folder (~/realsize/SIZE on an accelerator, else in the run's scratch
    folder unless --realsize), the world to copy, whether the servers have an accelerator."""
    folder = args.realsize or (Path.home() / "realsize" / sizes.serve_size if full else Path(scratch, "realsize"))
    return (("--realsize", str(Path(folder).absolute())) + (("--world", str(Path(args.world).absolute()))
                                                              if args.world else ())
            + (("--accelerated",) if accelerated else ()))


def markdown(result: dict) -> str:
    lines = [f"{result['mode']}", "", f"{result['hardware']}", "",
             "| measurement | batch | jax | torchscale | jax/torch | peak device memory (jax / torch) |",
             "|---|---|---|---|---|---|"]
    gib = lambda b: "-" if b is None else f"{b / 2**30:.2f} GiB"  # noqa: E731
    served = [r for r in result["rows"] if "served" in r or "workdir" in r]
    for r in result["rows"]:
        if r in served:
            continue
        if "ms_per_query" in r:
            jax_cell = f"{r['ms_per_query']:.2f} ms/query (paper {r['paper_ms']} ms)"
        elif "ms_per_doc" in r:
            jax_cell = f"{r['ms_per_doc']:.1f} ms/document"
        elif "summaries_s" in r:
            jax_cell = f"{r['summaries_s']:.1f} summaries/s"
        elif "jax_seq_s" in r:
            jax_cell = f"{r['jax_seq_s']:.1f} seq/s"
        else:
            jax_cell = "-"
        torch_cell = f"{r['torch_seq_s']:.1f} seq/s" if "torch_seq_s" in r else "-"
        ratio = f"{r['ratio']:.2f}x" if "ratio" in r else "-"
        lines.append(f"| {r['what']} | {r.get('batch', '-')} | {jax_cell} | {torch_cell} | {ratio} | "
                     f"{gib(r.get('jax_peak_bytes'))} / {gib(r.get('torch_peak_bytes'))} |")
    lines += accelerator_serve.markdown(served) if served else []
    lines += ["", f"total {result['seconds']:.0f} s of a {result['budget_s']:.0f} s budget; each unit (SR, a train "
              "size, an encoder, a BART dtype, the served query's build and each engine) ran in its own process, so "
              "each peak is that unit's own"]
    if result["failed"]:
        lines += ["", f"failed or stopped: {', '.join(result['failed'])} (their rows say why)"]
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse_args()
    if args.unit:  # a worker: one unit, its rows to --result
        sizes = Sizes(**json.loads(args.sizes_json)) if args.sizes_json else None
        if sizes is not None:
            sizes.train = tuple(sizes.train)
        if args.unit == "probe:host":
            out = accelerator_units.probe()
        else:
            serve = dict(realsize_dir=args.realsize, world=args.world, accelerated=args.accelerated,
                         forced=args.forced)
            out = accelerator_units.run_unit(args.unit, sizes, args.scratch, serve, forced=args.forced)
        Path(args.result).write_text(json.dumps(out))
        return
    result = drive(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("accelerator.json", json.dumps(result, indent=1) + "\n"), ("accelerator.md", markdown(result))):
        (out / f".{name}.tmp").write_text(text)
        (out / f".{name}.tmp").replace(out / name)
    print(markdown(result))
    print(f"wrote {out}/accelerator.json and accelerator.md", file=sys.stderr)
    if result["failed"]:
        print(f"accelerator.sh: {len(result['failed'])} of {len(result['units'])} units "
              f"failed or were stopped: {', '.join(result['failed'])}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main()
