"""The universal form's files as upstream's ``ds_to_universal`` (the installed 0.19.8) writes them, case by case,
and upstream's own loader reading ours.

Upstream writes two forms of ``zero/<param>/<state>.pt``: a dictionary (``param`` and keys such as ``cat_dim``) from
ZeRO-0/1/2 and from ZeRO-3 under AutoTP, and the bare flat tensor from ZeRO-3 at TP=1; from ZeRO-3 it writes no
``step.pt`` (the step is in ``zero/optimizer_state.pt``). Tools and tests that follow upstream read the form it
writes. Each case below converts one saved run both ways and compares every file (form, keys, values, bits) and
``zero/optimizer_state.pt``; the only differences left are those docs/universal-checkpoints.md names.
"""

from __future__ import annotations

import json

import pytest
import torch

from deepspeed_ext.checkpoint import serialization
from harness.scenario import Load, differences_from_upstream, upstream_ds_to_universal

#: The frozen run of tests/e2e/test_frozen_e2e.py (shared: trained once per test run).
SHARDED = r"embed_tokens|layers\.0\.self_attn\.q_proj|layers\.1\.mlp\.down_proj"


def _files(universal, name):
    return sorted(p.name for p in (universal / "zero" / name).iterdir())


def test_zero1_at_tp1_every_file_is_upstreams(scenarios, tmp_path):
    """ZeRO-1 at TP=1: dictionaries with ``cat_dim: 0`` on every tensor, as upstream writes them, a step.pt each, and
    the optimizer summary with paddings 0 (the merged tensors carry none)."""
    tp1 = scenarios("tp1_zero1_bf16", tp=1)
    # At TP=1 AutoTP records nothing for upstream's converter, which then needs to be told to go on without it.
    upstream = upstream_ds_to_universal(tp1.tag_dir, tmp_path / "upstream", "--inject_missing_state")
    assert differences_from_upstream(tp1.universal_dir, upstream) == []
    entry = serialization.load(tp1.universal_dir / "zero" / "model.norm.weight" / "fp32.pt")
    assert isinstance(entry, dict) and entry["cat_dim"] == 0
    assert _files(tp1.universal_dir, "model.norm.weight") == ["exp_avg.pt", "exp_avg_sq.pt", "fp32.pt", "step.pt"]
    summary = serialization.load(tp1.universal_dir / "zero" / "optimizer_state.pt")
    assert set(summary["group_paddings"]) == {0}


@pytest.fixture(scope="module")
def zero3(scenarios):
    return scenarios("frozen_sharded_dp2_zero3", tp=1, dp=2, zero=3, freeze=SHARDED)


def test_zero3_at_tp1_files_are_bare_flat_tensors_as_upstream_writes_them(zero3, tmp_path):
    """ZeRO-3 at DP=2, TP=1: every state the bare flat tensor, bit for bit upstream's, no step.pt; the frozen
    parameters are in ours only (upstream's converter leaves them out: docs/universal-checkpoints.md)."""
    frozen = json.loads((zero3.universal_dir / "deepspeed_ext.json").read_text())["frozen_params"]
    assert len(frozen) == 3
    upstream = upstream_ds_to_universal(zero3.tag_dir, tmp_path / "upstream")
    assert differences_from_upstream(zero3.universal_dir, upstream, only_ours=tuple(frozen)) == []
    weight = serialization.load(zero3.universal_dir / "zero" / "lm_head.weight" / "fp32.pt")
    assert torch.is_tensor(weight) and weight.dim() == 1
    assert _files(zero3.universal_dir, "lm_head.weight") == ["exp_avg.pt", "exp_avg_sq.pt", "fp32.pt"]
    assert _files(zero3.universal_dir, frozen[0]) == ["fp32.pt"]
    step = serialization.load(zero3.universal_dir / "zero" / "optimizer_state.pt")["optimizer_state_dict"]["state"]
    assert int(step[0]["step"]) == zero3.save_at


def test_upstreams_zero3_loader_reads_ours_as_ours_does(scenarios, tmp_path):
    """DeepSpeed's own ZeRO-3 universal loader (``--restore deepspeed``) on our flat files puts the same bits in
    every rank's partitions as our restore, at DP=2 and at DP=1 (a run with nothing frozen: upstream's loader
    restores no frozen weight, which our resume fingerprints then refuse)."""
    plain = scenarios("dp2_zero3_bf16", tp=1, dp=2, zero=3)
    upstream = upstream_ds_to_universal(plain.tag_dir, tmp_path / "upstream")
    assert differences_from_upstream(plain.universal_dir, upstream) == []
    for dp in (2, 1):
        (ours, ours_losses), (theirs, theirs_losses) = plain.loaded_many([
            Load(1, dp, plain.save_dir), Load(1, dp, plain.save_dir, extra=("--restore", "deepspeed"))])
        assert ours[0].keys() == theirs[0].keys() and ours[0]
        for name, states in theirs[0].items():
            for state, value in states.items():
                assert torch.equal(ours[0][name][state], value), (dp, name, state)
        assert ours_losses == theirs_losses
