"""TP and DP degrees from the files present, on a real engine's ZeRO-3 TP=2 x DP=2 checkpoint.

The checkpoint is the session's shared one (``tp2_dp2_zero3_bf16``, also in test_end_to_end.py). Each test works
on a copy as another writer would leave it: deepspeed-ext's own files (``deepspeed_ext*.json``) removed, so
upstream's ``universal_checkpoint_info`` is the only TP metadata, and, where a test says so, ``mp_world_size`` or
``dp_world_size`` removed from every model-states file. Such a copy was once read as TP=1 and converted to TP rank
0's shards alone; now it converts to what the original and upstream's ``ds_to_universal`` give, and a file missing
from it or left in it from another save is named. The file-set logic on fake files is tests/unit/test_degrees.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from deepspeed_ext.checkpoint import serialization
from harness.cli import universal_in
from harness.runner import cli
from harness.scenario import Scenario, upstream_ds_to_universal


@pytest.fixture(scope="module")
def zero3(scenarios) -> Scenario:
    return scenarios("tp2_dp2_zero3_bf16", tp=2, dp=2, zero=3)


def another_writers_copy(zero3: Scenario, root: Path, drop: tuple[str, ...] = ()) -> Path:
    """The tag under ``root`` (a save directory), without deepspeed-ext's files and without the model-states keys
    ``drop``."""
    tag = root / zero3.tag_dir.name
    shutil.copytree(zero3.tag_dir, tag)
    (root / "latest").write_text(tag.name)
    for path in tag.glob("deepspeed_ext*"):
        path.unlink()
    for path in sorted(tag.glob("*model_states.pt")):
        data = torch.load(path, weights_only=False)  # our own test file
        assert all(data.pop(key) for key in drop), path
        torch.save(data, path)
    return tag


def refusal(args: list[str], log: Path) -> str:
    proc = cli(args, log, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return lines[0]


@pytest.mark.parametrize("drop", [("mp_world_size", ), ("dp_world_size", )], ids=lambda drop: f"no-{drop[0]}")
def test_an_unrecorded_degree_is_taken_from_the_files(zero3, tmp_path, drop):
    """The copy converts to the same bytes as the original and to what upstream's converter makes of it;
    ``inspect`` says TP=2 x DP=2."""
    tag = another_writers_copy(zero3, tmp_path / "ckpt", drop)
    summary = json.loads(cli(["inspect", str(tag), "--json"], tmp_path / "inspect.log").stdout)
    assert (summary["tp_degree"], summary["dp_degree"], summary["zero_stage"]) == (2, 2, 3)
    assert summary["metadata"] == "deepspeed" and summary["num_parameters"] == 95168

    cli(["to-universal", str(tmp_path / "ckpt"), "-o", str(tmp_path / "uni"), "-q"], tmp_path / "convert.log")
    ours, original = universal_in(tmp_path / "uni"), zero3.universal_dir
    written = sorted(p.relative_to(original) for p in (original / "zero").rglob("*.pt"))
    assert written and written == sorted(p.relative_to(ours) for p in (ours / "zero").rglob("*.pt"))
    for relative in written:
        assert (ours / relative).read_bytes() == (original / relative).read_bytes(), relative
    # Upstream's ZeRO-3 output keeps the step in zero/optimizer_state.pt alone (no step.pt per parameter), so
    # harness.scenario.differences_from_upstream, which compares those too, does not apply.
    upstream = upstream_ds_to_universal(tag, tmp_path / "upstream")
    names = sorted(p.name for p in (ours / "zero").iterdir() if p.is_dir())
    assert names and names == sorted(p.name for p in (upstream / "zero").iterdir() if p.is_dir())
    for name in names:
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            a, b = (serialization.load(root / "zero" / name / f"{state}.pt")["param"] for root in (ours, upstream))
            assert a.shape == b.shape and torch.equal(a, b), (name, state, tuple(a.shape), tuple(b.shape))


@pytest.mark.parametrize("removed", ["zero_pp_rank_1_mp_rank_01_model_states.pt",
                                     "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt"])
def test_a_missing_file_is_named(zero3, tmp_path, removed):
    """Without ``mp_world_size`` nothing but the other files says TP rank 1 exists; the missing file is named."""
    tag = another_writers_copy(zero3, tmp_path / "ckpt", ("mp_world_size", ))
    (tag / removed).unlink()
    for command in (["to-universal", str(tmp_path / "ckpt"), "-o", str(tmp_path / "uni"), "-q"],
                    ["inspect", str(tag)]):
        line = refusal(command, tmp_path / f"{command[0]}.log")
        assert line.startswith(f"deepspeed-ext: error: {tag}: {removed} is missing (TP=2 x DP=2 from the files "
                               "present"), line
    assert not (tmp_path / "uni").exists()


@pytest.mark.parametrize("copied", ["zero_pp_rank_0_mp_rank_01_model_states.pt",
                                    "bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt"])
def test_a_file_left_from_a_save_at_another_degree_is_named(zero3, tmp_path, copied):
    """A ``mp_rank_02`` file beside a TP=2 save: named as beyond the TP degree the model states record."""
    tag = another_writers_copy(zero3, tmp_path / "ckpt")
    extra = copied.replace("mp_rank_01", "mp_rank_02")
    shutil.copy(tag / copied, tag / extra)
    line = refusal(["to-universal", str(tmp_path / "ckpt"), "-o", str(tmp_path / "uni"), "-q"],
                   tmp_path / "convert.log")
    assert line == (f"deepspeed-ext: error: {tag}: {extra} is beyond the TP degree: "
                    "zero_pp_rank_0_mp_rank_00_model_states.pt says TP=2, but there are files for 3 TP ranks (0..2): "
                    "files of two checkpoints are mixed, or the model states are wrong")
    assert not (tmp_path / "uni").exists()
