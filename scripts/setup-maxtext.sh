#!/usr/bin/env bash
# .venv-maxtext: MaxText 0.2.5's own model, config and checkpoint-loading code, for the tests that check our
# to-maxtext output with MaxText itself. Idempotent and quick when nothing changed.
#
# MaxText 0.2.5 declares Python >= 3.12 and pulls a full TPU/GPU training stack; its model code runs on 3.11.
# So: install it without its dependencies, then the pinned packages its modules import
# (requirements-maxtext.txt), then patch the three lines that need Python 3.12 or a newer JAX, each by exact
# text: a patch whose text is not found fails the setup, naming the file.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
VENV=.venv-maxtext
MAXTEXT=maxtext==0.2.5
START=$SECONDS
say() { echo "setup-maxtext: $* [$((SECONDS - START))s]" >&2; }

stamp="$VENV/.deepspeed_ext-maxtext-$(cat requirements-maxtext.txt scripts/setup-maxtext.sh | sha1sum | cut -c1-16)"
[ -f "$stamp" ] && exit 0
[ -x "$VENV/bin/python" ] || { say "creating $VENV"; "$PYTHON" -m venv "$VENV"; }
# As scripts/setup.sh does (pip_compiles): each module compiled as it is first imported (the import check below
# compiles what the tests import), unless PYTHONDONTWRITEBYTECODE would keep nothing.
compile=$([ -n "${PYTHONDONTWRITEBYTECODE:-}" ] || echo --no-compile)
say "installing $MAXTEXT and the packages its model code imports (first time: about a minute; log: $VENV/setup-pip.log)"
{
  "$VENV/bin/python" -m pip install -q --upgrade pip &&
  "$VENV/bin/python" -m pip install -q $compile -r requirements-maxtext.txt &&
  "$VENV/bin/python" -m pip install -q $compile --force-reinstall --no-deps --ignore-requires-python "$MAXTEXT"
} > "$VENV/setup-pip.log" 2>&1 || { tail -n 30 "$VENV/setup-pip.log" >&2; say "pip failed"; exit 1; }

say "patching MaxText for Python 3.11 and JAX 0.10"
"$VENV/bin/python" - <<'PY'
import pathlib
import maxtext

root = pathlib.Path(maxtext.__file__).parent
PATCHES = [  # (file, exact text, replacement)
    # PEP 695 type aliases (Python 3.12): plain assignments mean the same to the code that uses them.
    ("kernels/mhc/common.py", "type KernelContext = tuple[jax.Array, jax.Array, jax.Array]",
     "KernelContext = tuple[jax.Array, jax.Array, jax.Array]"),
    ("kernels/mhc/api.py", 'type Implementation = Literal["mosaic", "mosaic_tpu", "xla"]',
     'Implementation = Literal["mosaic", "mosaic_tpu", "xla"]'),
    # A newer JAX's fusion hint, used only inside the TPU flash-attention kernel (never on CPU).
    ("kernels/attention/jax_flash_attention.py", "from jax.experimental.xla_metadata import must_fuse_call\n",
     "try:\n  from jax.experimental.xla_metadata import must_fuse_call\n"
     "except ImportError:  # deepspeed-ext: JAX 0.10 has no must_fuse_call; the TPU kernel is not used on CPU\n"
     "  must_fuse_call = None\n"),
]
for relative, text, replacement in PATCHES:
    path = root / relative
    source = path.read_text()
    if source.count(text) != 1:
        raise SystemExit(f"setup-maxtext: {path}: the text to patch was not found exactly once: {text!r}")
    path.write_text(source.replace(text, replacement))
PY
JAX_PLATFORMS=cpu "$VENV/bin/python" -c "import maxtext.configs.pyconfig, maxtext.models.models, maxtext.common.checkpointing, maxtext.utils.maxtext_utils" \
  > /dev/null 2>&1 || { say "MaxText's modules do not import after patching"; exit 1; }
rm -f "$VENV"/.deepspeed_ext-maxtext-*
touch "$stamp"
say "ready"
