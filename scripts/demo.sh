#!/usr/bin/env bash
# The demo: train a built-in tiny Llama at TP=2, convert to universal, resume at TP=1/3/4 (no downloads).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh demo
exec .venv/bin/python -m deepspeed_ext.demo "$@"
