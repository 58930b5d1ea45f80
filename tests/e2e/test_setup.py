"""scripts/setup.sh builds what a command needs, says what it does, and keeps DeepSpeed's ops per venv.

Run here on the set-up checkout (the first, slow run is the README's first command on a fresh machine; its
times are in the README). ``setup.sh demo`` must not touch what only the tests need, and every venv's Python
must find its JIT-built ops in its own cache.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("mode", ["demo", "bridges"])
def test_demo_setup_builds_only_the_demo_environment_and_reports_progress(mode):
    """``demo`` and ``bridges`` (the demo's with every extra) after the tests' setup: nothing to install or build."""
    proc = subprocess.run(["bash", "scripts/setup.sh", mode], cwd=REPO, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert all(re.fullmatch(r"setup: .* \[\d+s\]", line) for line in lines), lines
    assert not any("0.18.8" in line or "FusedAdam" in line for line in lines), lines  # only the tests need them
    # The suite's setup built the comm op already: a setup run after that says nothing of building it.
    assert not any("building DeepSpeed ops" in line for line in lines), lines
    assert list((REPO / ".venv" / "torch_extensions").rglob("deepspeed_shm_comm*.so"))


def test_each_venv_keeps_its_own_op_cache():
    for venv in (".venv", ".venv-deepspeed-0.18.8"):
        python = REPO / venv / "bin" / "python"
        cache = subprocess.run([str(python), "-c", "import os; print(os.environ.get('TORCH_EXTENSIONS_DIR'))"],
                               capture_output=True, text=True, check=True, env={"PATH": "/usr/bin:/bin"}).stdout
        assert cache.strip() == str(REPO / venv / "torch_extensions"), (venv, cache)
        built = list((REPO / venv / "torch_extensions").rglob("deepspeed_shm_comm*.so"))
        assert built, f"{venv}: DeepSpeed's comm op is not in its own cache"
