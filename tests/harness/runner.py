"""Launch the demo training script under torchrun and the CLI in a subprocess, as the tests need it.

The demo's own runner (``deepspeed_ext.demo.runner``) does what the demo needs; this one adds what only tests
use: another Python environment (another DeepSpeed release) per run, failures returned instead of raised, and
the fp16 loss scales a run recorded.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from deepspeed_ext.demo import runner as demo_runner
from deepspeed_ext.demo.runner import read_losses

#: The demo training script plus the probes (state dumps, loss scales) tests read.
TRAIN_WORKER = Path(__file__).parent / "workers" / "train.py"
#: The CLI, stopped by a signal it sends itself at a named point of a conversion.
STOPPED_CLI_WORKER = Path(__file__).parent / "workers" / "stopped_cli.py"

__all__ = ["child_env", "cli", "cli_stopped", "read_loss_scales", "read_losses", "run_logged", "torchrun_train",
           "torchrun_train_runs"]


def child_env(python: str = sys.executable) -> dict[str, str]:
    env = demo_runner.child_env()
    if python != sys.executable:
        # Another environment (another DeepSpeed): its JIT-built ops in its own cache, where scripts/setup.sh
        # builds them, not in ours (inherited from this process). The venv's python is a symlink: not resolved.
        env["TORCH_EXTENSIONS_DIR"] = str(Path(python).absolute().parents[1] / "torch_extensions")
    return env


def run_logged(cmd: list[str], log: Path, check: bool = True, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` (``cmd[0]`` is the Python to use) with its output in ``log``; on failure raise with the tail,
    or with ``check=False`` return the failed process."""
    log.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(cmd, env=child_env(cmd[0]), capture_output=True, text=True,
                          timeout=demo_runner.TIMEOUT_S, cwd=cwd)
    log.write_text(f"$ {' '.join(cmd)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    if check and proc.returncode != 0:
        raise RuntimeError(f"command failed ({proc.returncode}), log {log}: {' '.join(cmd)}\n"
                           + _failure_tail(proc.stdout + proc.stderr))
    return proc


def _failure_tail(output: str, lines: int = 40) -> str:
    """The last ``lines`` lines the command's own code printed. torchrun's agent ends a failed run with its own
    traceback and report (which name the exit signal, not the cause); those are cut so the workers' last words
    show."""
    kept = output.splitlines()
    for i, line in enumerate(kept):
        if "torch/distributed/elastic/multiprocessing/api.py" in line and "failed (exitcode" in line:
            kept = kept[:i + 1]
            break
    return "\n".join(kept[-lines:])


def torchrun_train(nproc: int, args: list[str], log: Path, python: str = sys.executable,
                   check: bool = True) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node N workers/train.py ARGS`` (the demo's training script with the
    tests' probes; gloo on CPU) in ``python``'s environment; ``check=False`` returns a failed run."""
    return run_logged([python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                       str(TRAIN_WORKER), *args], log, check=check)


def torchrun_train_runs(nproc: int, runs: list[list[str]], log: Path, python: str = sys.executable) -> None:
    """Several runs of workers/train.py, one after the other in one ``torchrun`` (``train.py --runs``: a fresh model
    and engine each, the process group kept). All at one TP degree: DeepSpeed sets its TP groups once a process."""
    if len(runs) == 1:
        torchrun_train(nproc, runs[0], log, python=python)
        return
    listing = log.with_suffix(".runs.json")
    listing.parent.mkdir(parents=True, exist_ok=True)
    listing.write_text(json.dumps(runs))
    torchrun_train(nproc, ["--runs", str(listing)], log, python=python)


def cli(args: list[str], log: Path, check: bool = True, python: str = sys.executable) -> subprocess.CompletedProcess:
    """``deepspeed-ext ARGS`` in a subprocess of ``python``'s environment."""
    return run_logged([python, "-m", "deepspeed_ext", *args], log, check=check)


def cli_stopped(args: list[str], log: Path, *, point: str, count: int,
                sig: signal.Signals = signal.SIGKILL) -> subprocess.CompletedProcess:
    """``deepspeed-ext ARGS`` in a subprocess that sends itself ``sig`` the ``count``-th time the conversion
    reaches ``point`` (workers/stopped_cli.py: ``range-read``). Raises unless it was stopped there: a conversion
    that finished first, or ended any other way, would test nothing."""
    proc = run_logged([sys.executable, str(STOPPED_CLI_WORKER), point, str(count), sig.name, "--", *args], log,
                      check=False)
    if f"stopped at {point} #{count}" not in proc.stdout:
        raise AssertionError(f"deepspeed-ext {' '.join(args)} never reached {point} #{count} (exit "
                             f"{proc.returncode}; log {log}):\n{_failure_tail(proc.stdout + proc.stderr)}")
    return proc


def read_loss_scales(path: Path) -> dict[int, float | None]:
    """Per step, the fp16 loss scale the run ended the step with (None without loss scaling)."""
    return {int(step): scale for step, scale in json.loads(path.read_text()).get("loss_scales", {}).items()}
