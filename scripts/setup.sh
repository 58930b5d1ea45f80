#!/usr/bin/env bash
# Create .venv if missing, install the pinned dev environment and this package (editable), and build
# DeepSpeed's CPU shared-memory comm op once so no test waits on the JIT build. Idempotent and quick
# when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $PYTHON" >&2
  "$PYTHON" -m venv .venv
fi

stamp=".venv/.deepspeed_ext-deps-$(cat requirements-dev.txt setup.py | sha1sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "setup: installing dependencies (requirements-dev.txt) and deepspeed-ext" >&2
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r requirements-dev.txt
  .venv/bin/python -m pip install -q --no-deps -e .
  rm -f .venv/.deepspeed_ext-deps-*
  touch "$stamp"
fi

# DeepSpeed JIT-compiles this op on first CPU use (minutes); do it here, cached in torch's extension dir.
DS_ACCELERATOR=cpu .venv/bin/python - <<'PY' >&2
from deepspeed.accelerator import get_accelerator
get_accelerator().create_op_builder("ShareMemCommBuilder").load()
PY
