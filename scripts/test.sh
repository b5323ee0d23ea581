#!/usr/bin/env bash
# Sets up .venv and runs the test suite: the whole suite (the command CI runs), or with --quick the tier a developer
# runs before every commit: the unit tests of every room (tests/unit/), without the end-to-end runs of the commands
# (tests/e2e/) and without the tests marked slow; or with --benchmarks the tests of benchmarks/' scripts. Further
# arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# The suite leaves out the tests marked benchmark (a script of benchmarks/ run end to end: the accelerator script's
# dry run, the real-size builder, the training throughput's comparison): minutes of CPU that check a measurement's
# script, not the product; --benchmarks runs them (before a device session, after changing benchmarks/).
selection=(-m "not benchmark")
if [[ "${1:-}" == "--quick" ]]; then
  shift
  selection=(tests/unit -m "not slow and not benchmark")
elif [[ "${1:-}" == "--benchmarks" ]]; then
  shift
  selection=(-m benchmark)
fi
bash scripts/setup.sh test
. .venv/bin/activate
# Lint first (seconds): the style the code is held to (pyproject.toml [tool.ruff]).
ruff check --quiet .
# Two workers (pytest-xdist), each taking whole test files (their module fixtures built once): most tests wait on
# the commands they run in subprocesses, so two keep both cores busy; 1.7x the single worker's pace on 2 cores.
# Files in collection order, which puts the longest first (tests/conftest.py LONGEST_FIRST); xdist's own order (most
# tests first) left a one-test file of minutes, the soak, for the end.
exec python -m pytest -q -rs -n 2 --dist loadfile --no-loadscope-reorder "${selection[@]}" "$@"
