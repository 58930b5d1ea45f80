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


@pytest.mark.parametrize("command, source, extra", [
    ("to-hf", "hf", []), ("to-maxtext", "hf", []), ("to-maxtext", "hf", ["--no-ocdbt", "--compression", "none"]),
    ("from-hf", "hf", []),
    ("from-maxtext", "maxtext", []), ("reshard-orbax", "maxtext", ["--mesh", "tensor=2"])])
def test_a_full_disk_is_one_line_and_leaves_no_output(sources, tmp_path, command, source, extra):
    """RLIMIT_FSIZE (a full disk) while the bridges write: one line naming what could not be written, exit 2,
    no output and no .partial."""
    out = tmp_path / "out"
    args = [command, str(sources / source), "-o", str(out), "-q", *extra]
    script = ("import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (6 * 1024, 6 * 1024)); "
              "from deepspeed_ext.cli import main; "
              f"sys.exit(main({args!r}))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "DS_ACCELERATOR": "cpu", "JAX_PLATFORMS": "cpu"})
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert str(out) in lines[0] and ("cannot write" in lines[0] or "File too large" in lines[0]), lines
    assert not out.exists() and not out.with_name("out.partial").exists()


def _cli(*args: str) -> subprocess.CompletedProcess:
    """``python -m deepspeed_ext ARGS`` as its own process (forked by the harness's CLI server: a fresh
    interpreter's exit code, stdout and stderr), not checked."""
    import tempfile

    from harness.runner import cli
    with tempfile.TemporaryDirectory(prefix="reliability_cli_") as logs:
        return cli(list(args), Path(logs) / "cli.log", check=False)


@pytest.mark.parametrize("command", ["to-hf", "to-maxtext", "from-hf"])
def test_a_second_conversion_into_the_same_output_refuses_while_the_first_runs(sources, tmp_path, command):
    """A run building ``out`` holds the lock on ``out.partial``; a second run into ``out`` refuses in one line
    and leaves the first one's staging directory as it was. Once the first is gone (killed: its lock is
    released, its ``.partial`` stale), a new run clears it and publishes a complete output."""
    import fcntl
    out = tmp_path / "out"
    partial = tmp_path / "out.partial"
    partial.mkdir()
    (partial / "being-written").write_text("the first run's work")
    holder = os.open(partial, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        proc = _cli(command, str(sources / "hf"), "-o", str(out), "-q")
    finally:
        os.close(holder)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert "another deepspeed-ext run is writing this output" in lines[0] and str(out) in lines[0]
    assert (partial / "being-written").read_text() == "the first run's work" and not out.exists()

    proc = _cli(command, str(sources / "hf"), "-o", str(out), "-q")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not partial.exists()
    assert _cli("verify", str(out)).returncode == 0


def test_two_conversions_started_together_leave_one_complete_output(sources, tmp_path):
    """Two real runs into one output at once: each either publishes a complete output or refuses in one line;
    whatever is published verifies."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "deepspeed_ext", "to-hf", str(sources / "hf"), "-o", str(out), "-q", "--overwrite"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    runs = [subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    results = [(run.wait(), run.stderr.read()) for run in runs]
    for code, stderr in results:
        assert code == 0 or (code == 2 and len(stderr.strip().splitlines()) == 1
                             and "another deepspeed-ext run" in stderr), results
    assert any(code == 0 for code, _ in results)
    assert _cli("verify", str(out)).returncode == 0 and not out.with_name("out.partial").exists()


# --------------------------------------------------------------------------- structures DeepSpeed's tests build
def _zero3_copy(scenarios, root: Path) -> Path:
    """A copy of the ZeRO-3 save for a test to edit: without its commit marker, so that the reader's own checks
    of the edited files are reached (with it, any edit is a file that differs from the marker)."""
    import shutil

    from harness.scenario import without_commit_marker
    zero3 = scenarios("tp2_dp2_zero3_bf16", tp=2, dp=2, zero=3)
    shutil.copytree(zero3.tag_dir, root / zero3.tag_dir.name)
    (root / "latest").write_text(zero3.tag_dir.name)
    return without_commit_marker(root / zero3.tag_dir.name)


def _rewrite(path: Path, change) -> None:
    import torch
    data = torch.load(path, weights_only=False)
    change(data)
    torch.save(data, path)


def test_zero3_optimizer_state_as_a_list_converts_like_the_dict(scenarios, tmp_path):
    """DeepSpeed's own universal-checkpoint unit tests hand the converter ZeRO-3 files whose torch optimizer
    ``state`` is a list (one entry per index): it converts to the same tensors as the dict DeepSpeed writes."""
    import torch
    tag = _zero3_copy(scenarios, tmp_path / "ckpt")
    for optim in sorted(tag.glob("*optim_states.pt")):
        def as_list(data: dict) -> None:
            base = data["optimizer_state_dict"]["optimizer_state_dict"]
            base["state"] = [base["state"][key] for key in sorted(base["state"])]
        _rewrite(optim, as_list)
    proc = _cli("to-universal", str(tmp_path / "ckpt"), "-o", str(tmp_path / "uni"), "-q")
    assert proc.returncode == 0, proc.stderr[-2000:]
    reference = _cli("to-universal", str(scenarios("tp2_dp2_zero3_bf16", tp=2, dp=2, zero=3).save_dir), "-o",
                     str(tmp_path / "reference"), "-q")
    assert reference.returncode == 0, reference.stderr[-2000:]
    ours = sorted((tmp_path / "uni" / f"{tag.name}_universal" / "zero").glob("*/*.pt"))
    assert ours
    for path in ours:
        twin = tmp_path / "reference" / path.relative_to(tmp_path / "uni")
        a, b = torch.load(path, weights_only=True), torch.load(twin, weights_only=True)
        a, b = (x["param"] if isinstance(x, dict) else x for x in (a, b))
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)), path


@pytest.mark.parametrize("damage, expected", [
    ("state is a string", "the optimizer's 'state' is a str"),
    ("state entry is a tensor", "optimizer state entry 0 is a Tensor"),
    ("base state is a list", "the wrapped optimizer's state dict is a list"),
])
def test_unexpected_optimizer_structures_are_one_line_naming_the_file(scenarios, tmp_path, damage, expected):
    import torch
    tag = _zero3_copy(scenarios, tmp_path / "ckpt")
    target = sorted(tag.glob("*optim_states.pt"))[-1]

    def change(data: dict) -> None:
        outer = data["optimizer_state_dict"]
        if damage == "state is a string":
            outer["optimizer_state_dict"]["state"] = "oops"
        elif damage == "state entry is a tensor":
            outer["optimizer_state_dict"]["state"][0] = torch.zeros(1)
        else:
            outer["optimizer_state_dict"] = [outer["optimizer_state_dict"]]
    _rewrite(target, change)
    for command in (["to-universal", str(tmp_path / "ckpt"), "-o", str(tmp_path / "uni")], ["inspect", str(tag)]):
        proc = _cli(*command, "-q") if command[0] != "inspect" else _cli(*command)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, (command, proc.stderr[-2000:])
        assert str(target) in lines[0] and expected in lines[0], lines
    assert not (tmp_path / "uni").exists()


def test_a_missing_or_wrong_dp_world_size_is_named_as_such(scenarios, tmp_path):
    """Without ``dp_world_size`` the DP degree is the number of optimizer files per TP rank (the checkpoint then
    converts); a recorded DP that the files contradict is named as that mismatch, not as a ZeRO-3 sub-group
    problem."""
    tag = _zero3_copy(scenarios, tmp_path / "ckpt")
    models = sorted(tag.glob("*model_states.pt"))
    for path in models:
        _rewrite(path, lambda data: data.pop("dp_world_size"))
    proc = _cli("to-universal", str(tmp_path / "ckpt"), "-o", str(tmp_path / "uni"), "-q")
    assert proc.returncode == 0, proc.stderr[-2000:]
    for path in models:
        _rewrite(path, lambda data: data.update(dp_world_size=1))
    proc = _cli("to-universal", str(tmp_path / "ckpt"), "-o", str(tmp_path / "uni2"), "-q")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert "DP=1" in lines[0] and "optimizer files for 2 DP ranks" in lines[0] and "sub_group_size" not in lines[0]


def test_a_refusal_under_distributed_reaches_every_rank(scenarios, tmp_path):
    """``to-universal --distributed`` into an output another run is building: rank 0 refuses, and the other rank,
    rather than waiting at the first collective for a rank that gave up, stops with it; every rank has the same
    one-line message, which rank 0 says once."""
    import fcntl
    saved = scenarios("tp2_zero1_bf16", tp=2)
    out = tmp_path / "out"
    partial = tmp_path / "out.partial"
    partial.mkdir()
    holder = os.open(partial, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                   "deepspeed_ext", "to-universal", str(saved.save_dir), "-o", str(out), "--distributed", "-q"]
        proc = subprocess.run(command, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "DS_ACCELERATOR": "cpu"})
    finally:
        os.close(holder)
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("deepspeed-ext: error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "another deepspeed-ext run is writing this output" in errors[0], errors
    assert "refused on rank 0" in errors[0], errors
    assert partial.is_dir() and not out.exists()
