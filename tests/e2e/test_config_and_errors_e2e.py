"""Error paths of the CLI, run as a subprocess (``python -m deepspeed_ext``)."""

import os
import subprocess
import sys


def _cli(*args):
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    return subprocess.run([sys.executable, "-m", "deepspeed_ext", *args], capture_output=True, text=True, env=env)


def test_cli_error_is_one_line_and_non_zero(tmp_path):
    proc = _cli("to-universal", str(tmp_path / "nope"))
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"deepspeed-ext: error: {tmp_path / 'nope'}: no such checkpoint directory"
    (tmp_path / "empty").mkdir()
    proc = _cli("inspect", str(tmp_path / "empty"))
    assert proc.returncode == 2 and "neither a tag directory" in proc.stderr and "Traceback" not in proc.stderr
    proc = _cli("--debug", "inspect", str(tmp_path / "empty"))
    assert proc.returncode != 0 and "Traceback" in proc.stderr
