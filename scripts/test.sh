#!/usr/bin/env bash
# Sets up .venv and runs the whole test suite (the command CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
. .venv/bin/activate
exec python -m pytest -q -rs "$@"
