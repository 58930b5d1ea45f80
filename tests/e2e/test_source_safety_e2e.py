"""Never touch the source: the cases that need a subprocess (Ctrl-C, a closed stdout) or a real engine's
checkpoint (DeepSpeed sources). The rest is in tests/unit/test_source_safety.py."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.cli import assert_refused_everywhere, digest, make_formats, run
from harness.runner import cli_stopped
from harness.scenario import without_commit_marker


def spawn(*args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen([sys.executable, "-m", "deepspeed_ext", *args], env=env, **kwargs)


@pytest.fixture(scope="module")
def formats(tmp_path_factory) -> dict[str, Path]:
    """One checkpoint per format: HF (sharded safetensors), universal (from-hf's save directory), MaxText."""
    return make_formats(tmp_path_factory.mktemp("formats"))


# --------------------------------------------------------------------------- Ctrl-C and a closed stdout
@pytest.mark.parametrize("command", ["to-maxtext", "from-hf"])
def test_ctrl_c_is_one_line_exit_130_and_leaves_nothing(formats, tmp_path, command):
    """Ctrl-C (SIGINT) inside the write, once the 8th tensor range is handed to the writer (to-maxtext: inside
    Orbax's write of a leaf; from-hf: writer threads mid-file): one line, exit 130, nothing left beside the
    output's name (staging included), even a second later, and the source untouched."""
    source = formats["huggingface"]
    work = tmp_path / "work"
    work.mkdir()
    before = digest(source)
    proc = cli_stopped([command, str(source), "-o", str(work / "out"), "-q"], tmp_path / "interrupted.log",
                       point="range-read", count=8, sig=signal.SIGINT)
    assert proc.returncode == 130 and proc.stderr.strip() == "deepspeed-ext: interrupted; nothing was written", \
        proc.stderr
    time.sleep(1)  # a library thread that outlived the interrupt would write by now
    assert sorted(p.name for p in work.iterdir()) == [] and digest(source) == before


def test_a_closed_stdout_is_not_an_error(formats):
    """`deepspeed-ext inspect ... | head -1`: the reader goes away early; exit 0 and no error."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # closed before the command writes: every write to stdout fails with EPIPE
    proc = spawn("inspect", str(formats["universal"]), stdout=write_end, stderr=subprocess.PIPE, text=True)
    os.close(write_end)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "error" not in err.lower() and "Traceback" not in err, err


# --------------------------------------------------------------------------- DeepSpeed checkpoints (real engine)
def test_deepspeed_sources_are_never_written(scenarios, tmp_path, capsys):
    """to-universal, to-hf and to-maxtext on a real TP=2 engine checkpoint, named by its save directory and by its
    tag directory; then the one exception: to-universal without -o adds <tag>_universal and latest_universal
    beside the tag and changes no file of the checkpoint."""
    tp2 = scenarios("tp2_zero1_bf16", tp=2)
    work = tmp_path / "work"
    save_dir = work / "ckpt"
    shutil.copytree(tp2.save_dir, save_dir, ignore=shutil.ignore_patterns("*_universal", "latest_universal"))
    tag_dir = save_dir / tp2.tag_dir.name
    for command in ("to-universal", "to-hf", "to-maxtext"):
        assert_refused_everywhere(capsys, work, command, save_dir, [])
        assert_refused_everywhere(capsys, work, command, tag_dir, [])

    before = digest(save_dir)
    assert run(capsys, "to-universal", str(save_dir), "-q")[0] == 0
    after = digest(save_dir)
    assert {name: after[name] for name in before} == before
    added = {name.split("/")[0] for name in set(after) - set(before)}
    assert added == {f"{tag_dir.name}_universal", "latest_universal"}
    code, _, err = run(capsys, "to-universal", str(save_dir / f"{tag_dir.name}_universal"), "-q")
    assert code == 2 and "already a universal checkpoint" in err


def test_verify_checks_what_a_deepspeed_checkpoint_allows(scenarios, tmp_path, capsys):
    """No manifest there: every file loads safely, shards and replicas agree, every tensor finite; a damaged
    file is named."""
    tp2 = scenarios("tp2_zero1_bf16", tp=2)
    code, out, _ = run(capsys, "verify", str(tp2.tag_dir))
    assert code == 0 and "4 files load safely, 63 tensors" in out, out
    assert run(capsys, "verify", str(tp2.save_dir))[0] == 0
    damaged = tmp_path / "ckpt"
    shutil.copytree(tp2.tag_dir, damaged)
    optimizer = next(damaged.glob("*mp_rank_01_optim_states.pt"))
    size = optimizer.stat().st_size
    optimizer.write_bytes(optimizer.read_bytes()[:5000])
    # Committed by deepspeed-ext: the file is named against its commit marker.
    code, out, _ = run(capsys, "verify", str(damaged))
    assert code == 1 and f"{optimizer}: 5000 bytes, deepspeed_ext.commit.json says {size} (cut short" in out, out
    assert ": FAILED: " in out, out
    # Without the marker (a checkpoint deepspeed-ext did not save): the file is named as one that does not load.
    without_commit_marker(damaged)
    code, out, _ = run(capsys, "verify", str(damaged))
    assert code == 1 and f"{optimizer}: cannot read torch file" in out and ": FAILED: " in out, out
