"""Bad inputs to the bridges, the case that needs a subprocess: a full disk (RLIMIT_FSIZE) while they write.
The rest is in tests/unit/test_reliability.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli import make_sources


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    """A sharded HF checkpoint of the tiny Llama and its MaxText conversion."""
    return make_sources(tmp_path_factory.mktemp("sources"))


@pytest.mark.parametrize("command", ["to-hf", "to-maxtext", "from-hf"])
def test_a_full_disk_is_one_line_and_leaves_no_output(sources, tmp_path, command):
    """RLIMIT_FSIZE (a full disk) while the bridges write: one line naming what could not be written, exit 2,
    no output and no .partial."""
    out = tmp_path / "out"
    script = ("import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (6 * 1024, 6 * 1024)); "
              "from deepspeed_ext.cli import main; "
              f"sys.exit(main([{command!r}, {str(sources / 'hf')!r}, '-o', {str(out)!r}, '-q']))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "DS_ACCELERATOR": "cpu", "JAX_PLATFORMS": "cpu"})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert str(out) in lines[0] and ("cannot write" in lines[0] or "File too large" in lines[0]), lines
    assert not out.exists() and not out.with_name("out.partial").exists()
