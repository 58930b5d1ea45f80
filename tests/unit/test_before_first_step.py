"""A checkpoint saved before the first optimizer step (no step, no moments), and the agreement points of a
multi-rank run in one process (the ranks' own: tests/e2e/test_before_first_step_e2e.py)."""

from __future__ import annotations

import json
import os
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from deepspeed_ext.checkpoint import collective, serialization
from deepspeed_ext.checkpoint.deepspeed import keys
from deepspeed_ext.checkpoint.deepspeed.zero0 import TORCH_OPTIMIZER, SavedStage0
from deepspeed_ext.checkpoint.metadata import METADATA_FILE
from deepspeed_ext.errors import CheckpointError
from harness.scenario import without_commit_marker

ROOT = Path(__file__).resolve().parents[2]
TINY = {"vocab_size": 101, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


def _synth():
    sys.path.insert(0, str(ROOT / "bench"))
    import synth_checkpoint
    return synth_checkpoint


def test_a_zero1_save_before_the_first_step_converts_as_its_masters_alone(tmp_path):
    """ZeRO-1 at step 0 saves an empty ``base_optimizer_state``: the reader offers the fp32 masters alone (no
    moments, no step), to-universal writes ``fp32.pt`` alone per parameter, with the right values, and a
    restore finds no optimizer state to load (the engine keeps its fresh one)."""
    synth = _synth()
    plan = synth.make_plan(synth.llama_config_dict(TINY), tp=2)
    tag = without_commit_marker(synth.write_checkpoint(plan, tmp_path / "ckpt", tag="global_step0", log=False))
    for path in sorted(tag.glob("*_optim_states.pt")):
        states = serialization.load(path)
        states[keys.OPTIMIZER_STATE_DICT][keys.BASE_OPTIMIZER_STATE][keys.STATE] = {}
        temporary = path.with_suffix(".tmp")  # the loaded tensors map the file
        torch.save(states, temporary)
        os.replace(temporary, path)
    info_file = tag / METADATA_FILE  # a save at step 0 records the masters' fingerprints alone, and no step
    info = json.loads(info_file.read_text())
    fingerprints = info["fingerprints"]
    fingerprints["tensors"] = {name: {"fp32": states["fp32"]} for name, states in fingerprints["tensors"].items()}
    fingerprints["step"] = None
    info_file.write_text(json.dumps(info))

    from deepspeed_ext.api import convert
    from deepspeed_ext.checkpoint.deepspeed import DeepSpeedCheckpoint
    source = DeepSpeedCheckpoint(tmp_path / "ckpt")
    assert not source.has_optimizer_states and source.info.states == ("fp32", )
    name = plan.params[0].name
    assert source.has(name, "fp32") and not source.has(name, "exp_avg") and not source.has(name, "step")
    assert "before the first optimizer step" in source.summary()["optimizer_state"]
    out = convert(source, tmp_path / "universal", to="universal", progress=False)
    for param in plan.params:
        files = sorted(p.name for p in (out / "zero" / param.name).iterdir())
        assert files == ["fp32.pt"], (param.name, files)
        written = serialization.load(out / "zero" / param.name / "fp32.pt")["param"]
        assert torch.equal(written, synth.full_tensor(plan, param.name, "fp32")), param.name

    from deepspeed_ext.checkpoint.universal import UniversalCheckpoint
    assert not UniversalCheckpoint(out).has_optimizer_states


def _stage0_states(state: dict) -> dict:
    module = OrderedDict((f"w{i}", torch.full((2, 3), float(i))) for i in range(3))
    return {keys.MODULE: module, keys.OPTIMIZER: {keys.STATE: state, keys.PARAM_GROUPS: [{keys.PARAMS: [0, 1, 2]}]}}


def test_a_bare_torch_optimizer_before_its_first_step_keeps_every_parameter():
    """No ZeRO, fp32 (the torch optimizer saved bare): before the first step no parameter has state, and every one
    is converted (an empty entry, which an earlier save could leave, is no state); after it, a parameter without
    state is one the optimizer never stepped (frozen), and is left out."""
    for state in ({}, {1: {}}):
        saved = SavedStage0.read(_stage0_states(state), None, Path("mp_rank_00_model_states.pt"))
        assert saved.kind == TORCH_OPTIMIZER and list(saved.slots) == ["w0", "w1", "w2"], state
        assert torch.equal(saved.masters[2], torch.full((6, ), 2.0))
    stepped = {0: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(2, 3), "exp_avg_sq": torch.zeros(2, 3)},
               1: {}}
    saved = SavedStage0.read(_stage0_states(stepped), None, Path("mp_rank_00_model_states.pt"))
    assert list(saved.slots) == ["w0"]


def test_without_a_process_group_an_agreement_is_the_rank_alone():
    """One process (or a group of one): ``agree`` hands back the rank's value or raises its own error, unchanged,
    and ``on_every_rank`` is the call itself."""
    assert collective.agree(None, {"a": 1}) == [{"a": 1}]
    error = CheckpointError("x.pt: pipeline parallelism is not supported")
    with pytest.raises(CheckpointError) as raised:
        collective.agree(error)
    assert raised.value is error
    assert collective.on_every_rank(lambda: 7) == 7
    with pytest.raises(ValueError, match="bad"):
        collective.on_every_rank(lambda: (_ for _ in ()).throw(ValueError("bad")))
