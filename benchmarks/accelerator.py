"""Every accelerator measurement in one run (`bash benchmarks/accelerator.sh`): train step vs torchscale on the same
device, text and image encoding throughput, device SR ms/query, BART summaries/s, peak device memory of each; and,
with `--parts serve`, the served query at real size.

  bash benchmarks/accelerator.sh [--parts sr,train,encode,bart] [--batch 512 --steps 5 ...] [--out DIR]
  bash benchmarks/accelerator.sh --parts serve [--realsize DIR]

Each measured unit runs in its own process (SR; the train step of each size; text and image encoding; BART in each
dtype), so each unit's peak device memory is its own: XLA's peak_bytes_in_use is the high-water mark of the process
and cannot be reset, so in one process every row after the largest one repeats its peak. The run keeps to --budget
seconds (300 on an accelerator): each unit gets what is left less a reserve for the units after it, and a unit that
runs past its share is stopped and reported as such.

On a GPU (or TPU) host: base and large train steps in bfloat16 at batch --batch (torchscale's step on the same GPU,
interleaved, ratio printed), encoders at batch 256, device SR over a 4M x 768 float16 cache with ~60k-row unions
(one query per call and 64 per call) beside the paper's 4.7 ms, BART-large-CNN summaries/s. On a host without an
accelerator it says so and runs the same code paths at tiny sizes (CI runs it so; its figures are not accelerator
figures). Any size flag overrides the default of either mode. Writes --out/accelerator.json and --out/accelerator.md.

`--parts serve` (not in the default parts: it builds a 10 GB workdir) builds or reuses a real-size workdir in
--realsize (default ~/realsize/base on an accelerator; at tiny sizes the run's scratch folder) and serves it: the
single process, then Ray with 1 shard; p50 at concurrency 1, documents/s at concurrency 16 and the per-stage split
(benchmarks/accelerator_serve.py). Its budget is its own (540 s on an accelerator, within a 10-minute call, the
build included; a build cut short is completed by the next run), added to the other parts' when both are asked.
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
DEFAULT_PARTS = PARTS[:4]  # serve builds a real-size workdir first: asked for by name
RESERVE_S = 20.0  # kept back for each unit still to run when a unit's time limit is set
BUDGET_S = {True: 300.0, False: 900.0}  # the measurement parts: on an accelerator (5 minutes); tiny sizes on a CPU
SERVE_BUDGET_S = {True: 540.0, False: 1200.0}  # the serve part, its workdir's build included (a CPU: Ray)
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
    parser.add_argument("--budget", type=float, default=None, help="seconds for the whole run (300 on an "
                        "accelerator, 900 at tiny sizes on a CPU; serve adds 540 or 1200)")
    for field in dataclasses.fields(Sizes):
        kind = int if field.type == "int" else str
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=kind, default=None, help=SIZE_HELP[field.name])
    parser.add_argument("--unit", help=argparse.SUPPRESS)  # a worker process: measure one unit
    parser.add_argument("--sizes-json", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    parser.add_argument("--accelerated", action="store_true", help=argparse.SUPPRESS)
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


def default_budget(parts: tuple[str, ...], full: bool) -> float:
    """Seconds for the run: the measurement parts' budget if any is asked, plus the serve part's if it is."""
    return BUDGET_S[full] * bool(set(parts) - {"serve"}) + SERVE_BUDGET_S[full] * ("serve" in parts)


# --------------------------------------------------------------------------------------------------------- driver


def _spawn(unit: str, sizes: Sizes | None, limit: float, scratch: str | None = None,
           extra: tuple[str, ...] = ()) -> tuple[object, str]:
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
        env = dict(os.environ)
        # jax allocates as it goes: torchscale's step shares the GPU in the train units, and nothing is held back.
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
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
    found, why = _spawn("probe:host", None, 120.0)
    if found is None:
        raise SystemExit(f"accelerator.py: the probe of this host's jax {why}")
    accelerated = found["accelerated"]
    sizes = pick_sizes(args, accelerated)
    full = accelerated and not args.tiny
    budget = args.budget or default_budget(args.parts, full)
    if accelerated and not args.tiny:
        mode = f"accelerator measurements on {found['device_kind']} ({found['backend']})"
    else:
        mode = ("no accelerator on this host (jax backend: cpu): the same code paths at tiny sizes; these figures "
                "are NOT accelerator figures" if not accelerated else "tiny smoke run (--tiny) on the accelerator")
    print(mode, flush=True)
    plan, rows = units(args.parts, sizes), []
    scratch = tempfile.TemporaryDirectory(prefix="accelerator-")  # what units share (BART's model directory)
    serve = serve_args(args, sizes, full, accelerated, scratch.name)
    for i, unit in enumerate(plan):
        t = time.perf_counter()
        limit = budget - (t - start) - RESERVE_S * (len(plan) - i - 1)
        extra = serve if unit.startswith("serve:") else ()
        got, why = (_spawn(unit, sizes, limit, scratch.name, extra) if limit > 1
                    else (None, "not run: the run's budget was spent"))
        rows += got if got is not None else [{"what": f"{unit}: {why}", "unit": unit}]
        print(f"{unit}: {why or 'done'} in {time.perf_counter() - t:.0f} s (total {time.perf_counter() - start:.0f} "
              "s)", flush=True)
    scratch.cleanup()
    return {"mode": mode, "accelerator": accelerated and not args.tiny, "hardware": found["hardware"],
            "parts": list(args.parts), "sizes": dataclasses.asdict(sizes), "budget_s": budget, "rows": rows,
            "seconds": time.perf_counter() - start}


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
              "size, an encoder, a BART dtype) ran in its own process, so each peak is that unit's own", "",
              "The served query at the paper's sizes (spaCy, BART, the base text tower, SR over 4M rows, over HTTP), "
              "the single process and Ray with 1 shard: `bash benchmarks/accelerator.sh --parts serve` (it builds "
              "the real-size workdir first, 10 GB of disk; docs/real-size.md)."]
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
            serve = dict(realsize_dir=args.realsize, world=args.world, accelerated=args.accelerated)
            out = accelerator_units.run_unit(args.unit, sizes, args.scratch, serve)
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


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main()
