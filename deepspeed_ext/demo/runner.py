"""Launch the demo training script under torchrun and the CLI in a subprocess (used by the demo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TIMEOUT_S = 900


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    return env


def run_logged(cmd: list[str], log: Path) -> subprocess.CompletedProcess:
    """Run ``cmd`` with its output in ``log``; on failure raise with the tail."""
    log.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    log.write_text(f"$ {' '.join(cmd)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise RuntimeError(f"command failed ({proc.returncode}), log {log}: {' '.join(cmd)}\n{tail}")
    return proc


def torchrun_train(nproc: int, args: list[str], log: Path) -> None:
    """``torchrun --standalone --nproc_per_node N -m deepspeed_ext.demo.train ARGS`` (gloo on CPU)."""
    run_logged([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
                "deepspeed_ext.demo.train", *args], log)


def cli(args: list[str], log: Path) -> subprocess.CompletedProcess:
    return run_logged([sys.executable, "-m", "deepspeed_ext", *args], log)


def read_losses(path: Path) -> dict[int, float]:
    return {int(step): loss for step, loss in json.loads(path.read_text())["losses"].items()}
