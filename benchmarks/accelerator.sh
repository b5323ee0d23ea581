#!/usr/bin/env bash
# Every accelerator measurement in one run, within 5 minutes (benchmarks/accelerator.py has the list), each unit in
# its own process:
#   bash benchmarks/accelerator.sh [--parts sr,train,encode,bart] [--batch 512 --steps 5 ...] [--out DIR]
# and the served query at real size (a real-size workdir built or reused, then served by one process and by Ray with
# 1 shard), within 9 minutes:
#   bash benchmarks/accelerator.sh --parts serve [--realsize DIR]
# writes DIR/accelerator.json and DIR/accelerator.md (`--help` lists the size flags).
# On a GPU host install the CUDA jax first: .venv/bin/python -m pip install -e ".[cuda]". On a host without an
# accelerator it says so and runs the same code paths at tiny sizes (exit 0; CI runs it that way).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
if command -v nvidia-smi >/dev/null 2>&1 && ! "$PY" -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" \
    2>/dev/null; then
  echo "accelerator.sh: nvidia-smi sees a GPU but jax does not: pip install -e '.[cuda]' into the venv" >&2
fi
# No JAX_PLATFORMS: jax takes the accelerator when there is one, else the CPU.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TPU_STDERR_LOG_LEVEL=3 TPU_MIN_LOG_LEVEL=3
# accelerator.py keeps to its --budget (300 s on an accelerator, 540 s more with serve); the timeout is a backstop.
exec timeout 1800 "$PY" benchmarks/accelerator.py "$@"
