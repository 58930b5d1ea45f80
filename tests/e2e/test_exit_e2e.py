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
    """One run is enough: the crash at exit ("terminate called", gloo torn down under a live group) happens only
    some of the time, but what prevents it does not: each rank's marker, written by the last exit handler to run,
    says whether the process group was already ended by then, on every run."""
    root = tmp_path / "run"
    proc = run_logged([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                       str(WORKER), str(root / "ckpt"), str(root / "exit")], root / "run.log", check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "terminate called" not in output, output[-3000:]
    assert (root / "ckpt" / "latest").read_text().strip() == "global_step3"
    ends = sorted(path.read_text() for path in (root / "exit").iterdir())
    assert ends == ["process group ended"] * 4, ends


def test_pooled_ranks_leave_once_their_test_process_is_gone(tmp_path):
    """A test process that ends without running its exit handlers (an xdist worker ended at the close of a run)
    leaves no pooled torchrun behind: its ranks see it gone and leave, and torchrun with them; nor the zygote
    that forked those ranks (workers/zygote.py)."""
    import os
    import subprocess
    import time
    script = tmp_path / "owner.py"
    script.write_text(f"""
import os, sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
from pathlib import Path
from harness import runner
runner.torchrun_train(1, ["--tp", "1", "--steps", "1"], Path({str(tmp_path / "run.log")!r}))
pool = next(iter(runner._POOLS.values()))
print(pool.proc.pid, runner._ZYGOTES[sys.executable].proc.pid, *(p.read_text() for p in pool.directory.glob("pid.*")),
      flush=True)
os._exit(0)
""")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    pids = [int(pid) for pid in proc.stdout.split()]
    assert len(pids) == 3, proc.stdout

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        with open(f"/proc/{pid}/stat") as stat:  # an exited child of ours not yet reaped is gone too
            return stat.read().split(") ", 1)[1][0] != "Z"

    deadline = time.monotonic() + 60
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(pid) for pid in pids), pids
