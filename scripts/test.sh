#!/usr/bin/env bash
# Sets up .venv and runs the whole test suite (the command CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
. .venv/bin/activate
# Lint first (seconds): the style the code is held to (pyproject.toml [tool.ruff]).
ruff check --quiet .
exec python -m pytest -q -rs "$@"
