#!/usr/bin/env bash
# The whole test suite (unit, property and end-to-end tests on the real engine).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
# Two workers; tests that share fixtures stay together, the longest groups first (tests/conftest.py); trained
# checkpoints are trained once per run whichever worker asks (tests/harness/scenario.py).
exec .venv/bin/python -m pytest -n 2 --dist loadgroup --no-loadscope-reorder tests "$@"
