#!/usr/bin/env bash
# The whole test suite (unit, property and end-to-end tests on the real engine).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest tests "$@"
