#!/usr/bin/env bash
# Creates .venv (if missing) and installs cfir-jax with everything the demo and the tests need. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.cfir-setup-$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
  python -m pip install -q --upgrade pip
  # torch first and pinned: the CPU wheel (the test oracle and checkpoint reader, never a runtime need).
  python -m pip install -q "torch==2.13.0"
  python -m pip install -q -e ".[dev,torch]"
  # torchscale/fairscale declare timm/torchvision deps that do not import beside this torch: install without them.
  python -m pip install -q --no-deps "torchscale==0.3.0" "fairscale==0.4.0"
  touch "$stamp"
fi
