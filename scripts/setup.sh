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

# A second environment with DeepSpeed 0.18.8: AutoTP training without AutoTP universal-checkpoint tags,
# where deepspeed-ext's tags are the only metadata (tests/e2e/test_older_deepspeed.py).
OLD_DS=0.18.8
OLD_VENV=.venv-deepspeed-$OLD_DS
old_stamp="$OLD_VENV/.deepspeed_ext-deps-$(cat requirements-dev.txt setup.py | sha1sum | cut -c1-16)"
if [ ! -f "$old_stamp" ]; then
  echo "setup: creating $OLD_VENV (DeepSpeed $OLD_DS)" >&2
  [ -x "$OLD_VENV/bin/python" ] || "$PYTHON" -m venv "$OLD_VENV"
  "$OLD_VENV/bin/python" -m pip install -q --upgrade pip
  # Only the DeepSpeed side is tested there: no JAX/Orbax.
  grep -vE '^(deepspeed|jax|jaxlib|orbax-checkpoint|tensorstore|ml_dtypes|accelerate)==' requirements-dev.txt \
    > "$OLD_VENV/requirements.txt"
  "$OLD_VENV/bin/python" -m pip install -q -r "$OLD_VENV/requirements.txt" "deepspeed==$OLD_DS"
  "$OLD_VENV/bin/python" -m pip install -q --no-deps -e .
  rm -f "$OLD_VENV"/.deepspeed_ext-deps-*
  touch "$old_stamp"
fi

# DeepSpeed JIT-compiles these ops on first CPU use (about a minute each); do it here, cached in torch's
# extension dir: the shm comm op every run uses, and FusedAdam (the tests' FP16_Optimizer path).
DS_ACCELERATOR=cpu .venv/bin/python - <<'PY' >&2
from deepspeed.accelerator import get_accelerator
get_accelerator().create_op_builder("ShareMemCommBuilder").load()
get_accelerator().create_op_builder("FusedAdamBuilder").load()
PY
DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR="$PWD/$OLD_VENV/torch_extensions" "$OLD_VENV/bin/python" - <<'PY' >&2
from deepspeed.accelerator import get_accelerator
get_accelerator().create_op_builder("ShareMemCommBuilder").load()
PY
