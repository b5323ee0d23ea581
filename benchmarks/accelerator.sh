#!/usr/bin/env bash
# Every accelerator measurement in one run (benchmarks/accelerator.py has the list), each unit in its own process, the
# whole table within 8 minutes on one GPU (docs/compile-only.md, "One command on a lent device"):
#   bash benchmarks/accelerator.sh [--parts sr,train,encode,bart,serve] [--batch 512 --steps 5 ...] [--out DIR]
# the BART summarizer, the towers, SR at 4M x 768, the train step beside torchscale's, and the served query at real
# size (a real-size workdir built or reused, served by one process and by Ray with 1 shard, SR on the device).
# Writes DIR/accelerator.json and DIR/accelerator.md (`--help` lists the size flags). Each unit's time is printed as
# it ends; a unit that fails or runs past its share prints one line, the next one runs, and the script exits 1.
#   bash benchmarks/accelerator.sh --dry-run
# runs the same units at tiny sizes on the CPU with every device branch forced (what a host without an accelerator
# runs, and the test suite). On a GPU host install the CUDA jax first: pip install -e ".[cuda]"; PYTHON=python3 picks
# another interpreter than .venv's.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || command -v "$PY" >/dev/null 2>&1 || PY=python3
if command -v nvidia-smi >/dev/null 2>&1 && ! "$PY" -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" \
    2>/dev/null; then
  echo "accelerator.sh: nvidia-smi sees a GPU but jax does not: pip install -e '.[cuda]' into the venv" >&2
fi
# No JAX_PLATFORMS: jax takes the accelerator when there is one, else the CPU.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TPU_STDERR_LOG_LEVEL=3 TPU_MIN_LOG_LEVEL=3 PYTHONUNBUFFERED=1
# accelerator.py keeps to its --budget (480 s on an accelerator, 2100 s for the dry run); the timeout is a backstop.
exec timeout 2700 "$PY" benchmarks/accelerator.py "$@"
