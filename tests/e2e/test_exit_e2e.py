"""A training script that saves and returns, leaving its process group up as most do, exits 0: deepspeed-ext ends
the process group at exit, after the saves still being written, before the interpreter's teardown (left to it, a
process group's C++ threads can be destroyed while joinable: "terminate called without an active exception",
SIGABRT after the save committed). ZeRO-3 with a secondary partition at 4 ranks, where that abort was reported (2 of
6 runs), saved and exited three times."""

from __future__ import annotations

import sys
from pathlib import Path

from harness.runner import run_logged

WORKER = Path(__file__).resolve().parents[1] / "harness" / "workers" / "save_and_exit.py"


def test_a_multi_rank_save_and_exit_ends_cleanly(tmp_path):
    for attempt in range(3):
        root = tmp_path / f"run{attempt}"
        proc = run_logged([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                           str(WORKER), str(root / "ckpt"), str(root / "exit")], root / "run.log", check=False)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0 and "terminate called" not in output, (attempt, output[-3000:])
        assert (root / "ckpt" / "latest").read_text().strip() == "global_step3"
        ends = sorted(path.read_text() for path in (root / "exit").iterdir())
        assert ends == ["process group ended"] * 4, (attempt, ends)
