"""The Orbax-internals guard (deepspeed_ext/checkpoint/orbax_private.py) in .venv-maxtext, MaxText's own environment
(scripts/setup-maxtext.sh), whose Orbax restores our output in tests/e2e/test_maxtext_model_code.py: its pinned
Orbax must be the one the guard was written against too, so the internals check out there as well. Run as a
subprocess of that environment with this checkout on its path; this module imports no jax, so the guard runs even
where this environment lacks it. A missing .venv-maxtext fails under CI and skips elsewhere."""

from __future__ import annotations

import subprocess

from harness.environments import MAXTEXT_PYTHON, REPO, unavailable

GUARD = """
import orbax.checkpoint as ocp
from deepspeed_ext.checkpoint.orbax_private import TESTED_ORBAX, check_orbax_internals
check_orbax_internals()
assert ocp.__version__ == TESTED_ORBAX, f"orbax-checkpoint {ocp.__version__}, the guard is for {TESTED_ORBAX}"
print("orbax internals OK", ocp.__version__)
"""


def test_orbax_internals_are_there_in_maxtexts_environment(tmp_path):
    if not MAXTEXT_PYTHON.exists():
        unavailable(f"{MAXTEXT_PYTHON} is missing (scripts/setup-maxtext.sh)")
    proc = subprocess.run([str(MAXTEXT_PYTHON), "-c", GUARD], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0 and "orbax internals OK" in proc.stdout, proc.stdout + proc.stderr[-3000:]
