#!/usr/bin/env bash
# The whole test suite (unit, property and end-to-end tests on the real engine).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
# Two workers; tests that share trained checkpoints stay together (tests/conftest.py).
exec .venv/bin/python -m pytest -n 2 --dist loadgroup tests "$@"
