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


#: What the demo's training script prints of its progress (``--progress``): the demo shows those lines as they come.
PROGRESS = "deepspeed-ext demo: "


def run_logged(cmd: list[str], log: Path) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` with its output (stdout and stderr, as they come) in ``log``, showing its progress lines
    (:data:`PROGRESS`) meanwhile; on failure raise with the tail."""
    import threading
    log.parent.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    with open(log, "w") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        proc = subprocess.Popen(cmd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        timer = threading.Timer(TIMEOUT_S, proc.kill)
        timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                out.write(line)
                lines.append(line)
                if line.startswith(PROGRESS):
                    print(f"      {line[len(PROGRESS):].rstrip()}", flush=True)
            proc.wait()
        finally:
            timer.cancel()
    output = "".join(lines)
    if proc.returncode != 0:
        tail = "\n".join(output.splitlines()[-40:])
        raise RuntimeError(f"command failed ({proc.returncode}), log {log}: {' '.join(cmd)}\n{tail}")
    return subprocess.CompletedProcess(cmd, proc.returncode, output, "")


def torchrun_train(nproc: int, args: list[str], log: Path) -> None:
    """``torchrun --standalone --nproc_per_node N -m deepspeed_ext.demo.train ARGS`` (gloo on CPU)."""
    run_logged([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
                "deepspeed_ext.demo.train", *args], log)


def cli(args: list[str], log: Path) -> subprocess.CompletedProcess[str]:
    return run_logged([sys.executable, "-m", "deepspeed_ext", *args], log)


def read_losses(path: Path) -> dict[int, float]:
    return {int(step): loss for step, loss in json.loads(path.read_text())["losses"].items()}
