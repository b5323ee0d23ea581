"""What each keeper of compiled programs saves on a query's start: the second `retrieve.py --query`, whole process,
with every layer, then with one layer taken away at a time, and its floor, in one interleaved run.

    python benchmarks/program_layers.py --index demo_work [--runs 5] [--query examples/doc.txt]

The layers (docs/architecture.md, "Compiled programs"):
- JAX's persistent compilation cache (`cfir_jax.core.compile_cache`): a process still traces and lowers each
  function, then finds its compile on disk;
- the disk programs (`program_cache.DiskProgram` and `kept`, the sibling directory of JAX's cache): the compiled
  executable and the model's abstract state loaded whole, nothing traced;
- the in-process memo (`program_cache.memo`): a structure's jitted functions and abstract model made once per
  process (a query opens two models of one config).
A variant runs the command through `runpy` in a process where one layer is switched off by replacing its entry
point (never a switch of the product: `directory()` answering None, `memo` calling `make`, `enable` doing
nothing). "none" switches all three off. Each variant has a cache directory of its own, written by an untimed first
run, so each timed run is a second run. Prints a markdown table for benchmarks/RESULTS.md: each variant's median
(min-max), its ratio to "all" (what the layer saves) and to the floor (`python -c "import jax, flax.nnx"`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from startup import timed  # the script's folder is on sys.path

REPO = Path(__file__).resolve().parent.parent

# Runs retrieve.py in this process with the layers named in argv[1] (comma-separated) switched off.
RUN = r"""
import runpy, sys
off = set(filter(None, sys.argv[1].split(",")))
from cfir_jax.core import compile_cache
from cfir_jax.model import program_cache
if "jax-cache" in off:
    compile_cache.enable = lambda *a, **k: None
if "disk-programs" in off:
    program_cache.directory = lambda: None
if "memo" in off:
    program_cache.memo = lambda name, key, make: make()
sys.argv = ["retrieve.py", *sys.argv[2:]]
runpy.run_path("retrieve.py", run_name="__main__")
"""

VARIANTS = {  # name -> the layers switched off
    "all": "",
    "without the memo": "memo",
    "without the disk programs": "disk-programs",
    "without JAX's cache": "jax-cache",
    "none": "memo,disk-programs,jax-cache",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--index", required=True, help="a built workdir (demo_work)")
    parser.add_argument("--query", default="examples/doc.txt")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    index, query = str(Path(args.index).resolve()), str(Path(args.query).resolve())
    scratch = Path(tempfile.mkdtemp(prefix="program-layers-"))
    base = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "PYTHONPATH")}
    envs = {name: {**base, "PYTHONPATH": str(REPO), "CFIR_CACHE_DIR": str(scratch / str(n))}
            for n, name in enumerate(VARIANTS)}
    commands = {name: [sys.executable, "-c", RUN, off, "--index", index, "--query", query]
                for name, off in VARIANTS.items()}
    for name in VARIANTS:  # the first run writes the variant's cache
        timed(commands[name], REPO, envs[name])
    walls: dict[str, list[float]] = {name: [] for name in ["floor", *VARIANTS]}
    for _ in range(args.runs):
        walls["floor"].append(timed([sys.executable, "-c", "import jax, flax.nnx"], REPO, envs["all"]))
        for name in VARIANTS:
            walls[name].append(timed(commands[name], REPO, envs[name]))
    print_table(walls, args.runs)


def print_table(walls: dict[str, list[float]], runs: int) -> None:
    med = {name: statistics.median(v) for name, v in walls.items()}
    print(f"{runs} runs each, interleaved; median (min-max) of the whole process's wall time, the second run of each "
          f"variant's cache; load at the end {os.getloadavg()[0]:.1f}")
    print()
    print("| `retrieve.py --query`, second run | wall | / all | / floor |")
    print("|---|---|---|---|")
    for name, values in walls.items():
        v = sorted(values)
        label = '`python -c "import jax, flax.nnx"` (floor)' if name == "floor" else name
        print(f"| {label} | {med[name]:.2f} s ({v[0]:.2f}-{v[-1]:.2f}) | {med[name] / med['all']:.2f} | "
              f"{med[name] / med['floor']:.2f} |")


if __name__ == "__main__":
    main()
