#!/usr/bin/env bash
# The whole test suite (unit, property and end-to-end tests on the real engine).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
# Three workers on this 2-core machine: a test spends part of its time waiting (on torchrun's start, a gloo
# barrier, the disk), which a third worker fills. Tests that share fixtures stay together, the longest groups
# first (tests/conftest.py); trained checkpoints are trained once per run whichever worker asks
# (tests/harness/scenario.py). DSX_TEST_WORKERS=N to choose. The run ends with its 10 slowest tests (what to
# look at first when the suite's time grows).
# --fast: the fast tier (README), tests/unit/ without the cases only the whole suite runs (tests/harness/tiers.py).
tier=()
if [[ "${1:-}" == "--fast" ]]; then
  shift
  tier=(-m "not e2e and not full")
fi
exec .venv/bin/python -m pytest -n "${DSX_TEST_WORKERS:-3}" --dist loadgroup --no-loadscope-reorder --durations=10 \
  tests "${tier[@]}" "$@"
