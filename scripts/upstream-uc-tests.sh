#!/usr/bin/env bash
# DeepSpeed's own universal-checkpoint tests, run twice on this machine's CPU: with upstream's ds_to_universal, then
# with deepspeed-ext's converter in its place, in every rank the tests start (tests/upstream/sitecustomize.py). Prints every
# test that passes with upstream's converter and not with ours; docs/universal-checkpoints.md names each and why.
#
#   bash scripts/upstream-uc-tests.sh DEEPSPEED_CHECKOUT [PYTEST ARGS...]
#
# DEEPSPEED_CHECKOUT: a clone of github.com/deepspeedai/DeepSpeed (its tests/ directory; the installed DeepSpeed is
# the one tested). Not part of the suite: it needs that clone, and takes about 15 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
CHECKOUT=$(cd "${1:?usage: upstream-uc-tests.sh DEEPSPEED_CHECKOUT [PYTEST ARGS...]}" && pwd)
shift
bash scripts/setup.sh demo
PYTHON=$REPO/.venv/bin/python
# DeepSpeed's test harness (DistributedFixture) needs the pytest its CI pins (>=7.2,<8.4), kept apart from ours.
PYTEST_DIR=$REPO/.upstream-pytest
[ -d "$PYTEST_DIR" ] || "$PYTHON" -m pip install -q --target "$PYTEST_DIR" "pytest>=7.2.0,<8.4.0" pytest-forked >&2
OUT=$(mktemp -d)
# LOCAL_SIZE: the CPU accelerator's device count, which DeepSpeed's DistributedTest checks before it starts 2-4 ranks
# (gloo on the CPU); without it those tests skip as "not enough GPUs".
# UPSTREAM_UC_TESTS: other test ids (space-separated) than every file that converts with ds_to_universal.
# shellcheck disable=SC2206
TESTS=(${UPSTREAM_UC_TESTS:-unit/checkpoint/test_universal_checkpoint.py unit/checkpoint/test_autotp_uc_checkpoint.py
       unit/checkpoint/test_reshape_checkpoint.py unit/v1/moe/test_autoep_checkpoint.py unit/v1/moe/test_autoep_unit.py})
run() {  # run NAME SHIM: SHIM 1 puts deepspeed-ext's converter in place of upstream's
  local name=$1 shim=$2; shift 2
  (cd "$CHECKOUT/tests" && DSX_AS_DS_TO_UNIVERSAL=$shim DS_ACCELERATOR=cpu LOCAL_SIZE=4 PYTHONPATH="$PYTEST_DIR:$REPO/tests/upstream" DSX_CONVERSIONS_LOG="$OUT/$name.conversions" \
    "$PYTHON" -m pytest -p no:cacheprovider -q "$@" --junitxml="$OUT/$name.xml" "${TESTS[@]}" "${EXTRA[@]}" \
    > "$OUT/$name.log" 2>&1) || true
  echo "upstream-uc-tests: $name: $(tail -1 "$OUT/$name.log")" >&2
}
EXTRA=("$@")
run upstream 0
run deepspeed-ext 1
"$PYTHON" - "$OUT" <<'PY'
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

out = Path(sys.argv[1])

def outcomes(name):
    found = {}
    for case in ET.parse(out / f"{name}.xml").iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        found[test] = ("failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed",
                       next((c.get("message", "") for c in case if c.tag in ("failure", "error")), ""))
    return found

upstream, ours = outcomes("upstream"), outcomes("deepspeed-ext")
conversions = (out / "deepspeed-ext.conversions")
count = len(conversions.read_text().splitlines()) if conversions.exists() else 0
print(f"{sum(v[0] == 'passed' for v in upstream.values())} of {len(upstream)} pass with upstream's converter, "
      f"{sum(v[0] == 'passed' for v in ours.values())} with deepspeed-ext's ({count} conversions by deepspeed-ext)")
worse = [t for t, (outcome, _) in upstream.items() if outcome == "passed" and ours.get(t, ("missing",))[0] != "passed"]
for test in worse:
    print(f"passes with upstream's only: {test}: {ours.get(test, ('missing', ''))[1][:300]}")
print(f"logs: {out}")
PY
