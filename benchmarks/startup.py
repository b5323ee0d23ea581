"""A command's start against its floor, this tree against another (the commit before), in one interleaved run.

    python benchmarks/startup.py --index demo_work --base /tmp/startup-base [--runs 5] [--query examples/doc.txt]

Each figure is a whole process timed from outside (start to exit, a monotonic clock), `--runs` times, the trees and
figures in turn (one run of each, repeated) so that a load spike hits them alike; medians are quoted, with the
spread. The figures, for each tree:
- `python -c "import cfir_jax"`;
- `retrieve.py --index W --query Q`, first run (an empty compilation cache: CFIR_CACHE_DIR in a new empty folder)
  and second run (the cache its first run wrote); a tree without the cache compiles on every run;
- a search in a process that opened the index (the Python API's `cfir_jax.open(W).search(text)` where the tree has
  it, else `Retriever(config, W).retrieve(text)`): its wall time against the sum of its own stage times;
and once: the floor, `python -c "import jax, flax.nnx"`. Prints a markdown table (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Run inside a tree: opens the index once, then searches `n` times; prints each search's wall and stage-sum ms.
IN_PROCESS = r"""
import json, sys, time
from pathlib import Path
workdir, text, n = sys.argv[1], Path(sys.argv[2]).read_text(), int(sys.argv[3])
import cfir_jax
if hasattr(cfir_jax, "open"):  # the Python API
    index = cfir_jax.open(workdir)
    search, api = (lambda: index.search(text)), "Index.search after cfir_jax.open"
else:
    from cfir_jax.core.cli import workdir_config
    from cfir_jax.retrieve.pipeline import Retriever
    retriever = Retriever(workdir_config(workdir), workdir)
    search, api = (lambda: retriever.retrieve(text)), "Retriever.retrieve after Retriever(config, W)"
times = lambda r: getattr(r, "times_ms", None) or getattr(r, "times")
search()  # the first search loads spaCy and compiles: a start, not a search
rows = []
for _ in range(n):
    t0 = time.perf_counter()
    result = search()
    rows.append(((time.perf_counter() - t0) * 1e3, sum(times(result).values())))
print(json.dumps({"api": api, "rows": rows}))
"""


def timed(cmd: list[str], cwd: Path, env: dict) -> float:
    """Wall seconds of one whole process; a failure stops the benchmark with its output."""
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} (in {cwd}) failed:\n{proc.stderr[-3000:]}")
    return wall


def tree_env(tree: Path, cache: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_COMPILATION_CACHE_DIR", "PYTHONPATH")}
    return {**env, "PYTHONPATH": str(tree), "CFIR_CACHE_DIR": cache}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--index", required=True, help="a built workdir (demo_work)")
    parser.add_argument("--base", required=True, help="the other tree, e.g. the commit before checked out")
    parser.add_argument("--query", default="examples/doc.txt")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--searches", type=int, default=20, help="searches timed in the open-index process")
    args = parser.parse_args()
    trees = {"before": Path(args.base).resolve(), "after": REPO}
    index, query = str(Path(args.index).resolve()), str(Path(args.query).resolve())
    py = sys.executable
    scratch = Path(tempfile.mkdtemp(prefix="startup-bench-"))
    warm = {name: str(scratch / f"warm-{name}") for name in trees}
    walls: dict[tuple[str, str], list[float]] = {}
    figures = {
        "import": lambda tree, name, r: [py, "-c", "import cfir_jax"],
        "query, first run": lambda tree, name, r: [py, "retrieve.py", "--index", index, "--query", query],
        "query, second run": lambda tree, name, r: [py, "retrieve.py", "--index", index, "--query", query],
    }
    for name, tree in trees.items():  # a first run writes the warm cache (and the OS's file cache is warm for both)
        timed([py, "retrieve.py", "--index", index, "--query", query], tree, tree_env(tree, warm[name]))
    for r in range(args.runs):
        walls.setdefault(("floor", ""), []).append(
            timed([py, "-c", "import jax, flax.nnx"], REPO, tree_env(REPO, warm["after"])))
        for name, tree in trees.items():
            for figure, cmd in figures.items():
                cache = str(scratch / f"cold-{name}-{r}") if figure == "query, first run" else warm[name]
                walls.setdefault((figure, name), []).append(timed(cmd(tree, name, r), tree, tree_env(tree, cache)))
    in_process = {}
    for name, tree in trees.items():
        proc = subprocess.run([py, "-c", IN_PROCESS, index, query, str(args.searches)], cwd=tree,
                              env=tree_env(tree, warm[name]), capture_output=True, text=True, check=True)
        in_process[name] = json.loads(proc.stdout.splitlines()[-1])
    print_table(walls, in_process, args.runs)


def spread(values: list[float], scale: float = 1.0, unit: str = "s") -> str:
    v = sorted(x * scale for x in values)
    digits = 2 if unit == "s" else 1
    return f"{statistics.median(v):.{digits}f} {unit} ({v[0]:.{digits}f}-{v[-1]:.{digits}f})"


def print_table(walls: dict, in_process: dict, runs: int) -> None:
    floor = statistics.median(walls[("floor", "")])
    load = os.getloadavg()[0]
    print(f"{runs} runs each, interleaved; median (min-max) of the whole process's wall time; load at the end "
          f"{load:.1f}")
    print()
    print("| figure | before | after | after / before | after / floor |")
    print("|---|---|---|---|---|")
    print(f"| floor: `python -c \"import jax, flax.nnx\"` | | {spread(walls[('floor', '')])} | | 1.00 |")
    for figure in ("import", "query, first run", "query, second run"):
        before, after = walls[(figure, "before")], walls[(figure, "after")]
        med_b, med_a = statistics.median(before), statistics.median(after)
        label = "`python -c \"import cfir_jax\"`" if figure == "import" else \
            f"`retrieve.py --query`, {figure.split(', ')[1]}"
        print(f"| {label} | {spread(before)} | {spread(after)} | {med_a / med_b:.2f} | {med_a / floor:.2f} |")
    for name in ("before", "after"):
        rows = in_process[name]["rows"]
        wall = [w for w, _ in rows]
        ratio = statistics.median(w / s for w, s in rows)
        print(f"| {name}: one search, {in_process[name]['api']} | | {spread(wall, unit='ms')} | "
              f"wall / stage sum {ratio:.2f} | |")


if __name__ == "__main__":
    main()
