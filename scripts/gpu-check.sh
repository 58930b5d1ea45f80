#!/usr/bin/env bash
# The checks that need an accelerator, as one command (scripts/gpu_check.py says what each checks): train on CUDA,
# save synchronously and in the background (the copy snapshot), resume across devices and TP degrees, convert a
# GPU-saved checkpoint, stream its weights to a receiver, and the async stall bench at a 1B shape. Prints
# PASS/FAIL per check; non-zero if any failed.
#
#   bash scripts/gpu-check.sh                # on a machine with one CUDA GPU
#   bash scripts/gpu-check.sh --device cpu   # a dry run of the script on a machine without one
#
# Python: DSX_GPU_PYTHON, else this checkout's .venv where it has DeepSpeed, else python3 (a GPU machine's, which
# holds torch with CUDA). Packages it lacks (DeepSpeed) can travel as wheels in .whl/: installed into a scratch
# directory first, nothing fetched.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${DSX_GPU_PYTHON:-}
if [ -z "$PYTHON" ]; then
  if [ -x .venv/bin/python ] && .venv/bin/python -c "import deepspeed" >/dev/null 2>&1; then
    PYTHON=.venv/bin/python
  else
    PYTHON=python3
  fi
fi
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/dsx-gpu-site \
    .whl/*.whl
  export PYTHONPATH=/tmp/dsx-gpu-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
exec "$PYTHON" scripts/gpu_check.py "$@"
