"""Long-mode fuzzing: tests/unit/test_fuzz.py and tests/e2e/test_fuzz_e2e.py with many examples per reader
(the suite runs 25, derandomized).

    python bench/fuzz.py                  # 2000 examples per reader, random seeds
    python bench/fuzz.py --examples 500 --no-e2e

Every example damages one file of a small valid checkpoint (HF, universal, MaxText, a real DeepSpeed TP=2 engine
checkpoint), reads it as the converters do and checks it with ``verify``. It passes only if the damage is detected
(a deepspeed-ext error naming the file, or a problem ``verify`` reports) or is shown to be of a class no reader can
detect (tests/harness/fuzz.py: UNDETECTABLE); hypothesis' statistics, printed at the end, count each outcome per
reader.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--examples", type=int, default=2000)
    p.add_argument("--no-e2e", action="store_true", help="skip the DeepSpeed reader (it trains a tiny model first)")
    args = p.parse_args()
    files = ["tests/unit/test_fuzz.py"] + ([] if args.no_e2e else ["tests/e2e/test_fuzz_e2e.py"])
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--hypothesis-show-statistics", *files]
    env = {**os.environ, "DEEPSPEED_EXT_FUZZ_EXAMPLES": str(args.examples), "DS_ACCELERATOR": "cpu"}
    sys.exit(subprocess.run(cmd, cwd=ROOT, env=env).returncode)


if __name__ == "__main__":
    main()
