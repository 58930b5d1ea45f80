"""Any optimizer's states, not just Adam's, on checkpoints written in DeepSpeed's ZeRO-1 layout without training
(the real engine's: tests/e2e/test_any_optimizer_e2e.py): each state the optimizer keeps is read, written and read
back under its own key; a state not laid out like its parameters is refused in one line."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from deepspeed_ext.checkpoint import serialization
from deepspeed_ext.checkpoint.deepspeed import keys
from deepspeed_ext.checkpoint.states import ordered_states
from deepspeed_ext.errors import CheckpointError
from harness.scenario import without_commit_marker

ROOT = Path(__file__).resolve().parents[2]
TINY = {"vocab_size": 101, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}


def _rewrite_states(tag: Path, edit) -> None:
    """Apply ``edit(group_state) -> group_state`` to every param group's state in every optimizer file."""
    for path in sorted(tag.glob("*_optim_states.pt")):
        states = serialization.load(path)
        base = states[keys.OPTIMIZER_STATE_DICT][keys.BASE_OPTIMIZER_STATE]
        base[keys.STATE] = {group: edit({k: (v.clone() if torch.is_tensor(v) else v) for k, v in entry.items()})
                            for group, entry in base[keys.STATE].items()}
        temporary = path.with_suffix(".tmp")  # the loaded tensors map the file
        torch.save(states, temporary)
        os.replace(temporary, path)


@pytest.fixture
def sgd_checkpoint(tmp_path):
    """A TP=2 ZeRO-1 checkpoint whose optimizer kept SGD's state: a momentum per parameter, no step (the first
    Adam moments of a synthetic checkpoint renamed, so the values are known)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import synth_checkpoint
    plan = synth_checkpoint.make_plan(synth_checkpoint.llama_config_dict(TINY), tp=2)
    tag = without_commit_marker(synth_checkpoint.write_checkpoint(plan, tmp_path / "ckpt", log=False))
    _rewrite_states(tag, lambda entry: {"momentum_buffer": entry["exp_avg"]})
    info_file = tag / "deepspeed_ext.json"  # the record of what was saved: the same values, under SGD's key
    info = json.loads(info_file.read_text())
    info["fingerprints"]["tensors"] = {name: {"fp32": states["fp32"], "momentum_buffer": states["exp_avg"]}
                                       for name, states in info["fingerprints"]["tensors"].items()}
    info["fingerprints"]["step"] = None
    info_file.write_text(json.dumps(info))
    return tmp_path / "ckpt", plan


def test_ordered_states_keep_adams_order_and_put_scalars_last():
    assert ordered_states(["exp_avg_sq", "step", "exp_avg"], ["step"]) == ("fp32", "exp_avg", "exp_avg_sq", "step")
    assert ordered_states(["sum", "momentum_buffer"], ["mu_product", "step"]) == (
        "fp32", "momentum_buffer", "sum", "mu_product", "step")


def test_sgd_momentum_is_read_written_and_read_back_under_its_own_key(sgd_checkpoint, tmp_path, capsys):
    from deepspeed_ext.api import convert
    from deepspeed_ext.checkpoint.deepspeed import DeepSpeedCheckpoint
    from deepspeed_ext.checkpoint.universal import UniversalCheckpoint
    from deepspeed_ext.cli import main
    save_dir, plan = sgd_checkpoint
    source = DeepSpeedCheckpoint(save_dir)
    assert source.info.states == ("fp32", "momentum_buffer") and source.info.has_optimizer
    assert source.summary()["optimizer_states"] == {"fp32/momentum_buffer": len(plan.params)}
    out = convert(source, tmp_path / "universal", to="universal", progress=False)
    universal = UniversalCheckpoint(out)
    for tensor in source.tensors():
        assert sorted(p.name for p in (out / "zero" / tensor.name).iterdir()) == ["fp32.pt", "momentum_buffer.pt"]
        assert universal.states_of(tensor.name) == (("fp32", "momentum_buffer"), ())
        assert torch.equal(universal.load(tensor.name, "momentum_buffer"), tensor.load_tensor("momentum_buffer"))
    assert main(["compare", str(save_dir), str(out)]) == 0
    assert main(["verify", str(out)]) == 0
    capsys.readouterr()
    assert main(["to-maxtext", str(save_dir), "-o", str(tmp_path / "maxtext"), "--with-optimizer"]) != 0
    error = capsys.readouterr().err.strip()
    assert "--with-optimizer carries Adam/AdamW moments" in error and "momentum_buffer" in error
    assert len(error.splitlines()) == 1 and not (tmp_path / "maxtext").exists()


def test_a_state_not_laid_out_like_its_parameters_is_refused_in_one_line(sgd_checkpoint, tmp_path):
    """An Adafactor-style factored moment (one value per row) cannot be resharded with its parameter: named, with
    its shape, and nothing is written."""
    from deepspeed_ext.api import convert
    from deepspeed_ext.checkpoint.deepspeed import DeepSpeedCheckpoint
    save_dir, _ = sgd_checkpoint
    tag = next(save_dir.glob("global_step*"))
    _rewrite_states(tag, lambda entry: {**entry, "exp_avg_sq_row": torch.ones(7)})
    with pytest.raises(CheckpointError, match=r"state 'exp_avg_sq_row' of shape \(7,\) for param group 0") as error:
        convert(DeepSpeedCheckpoint(save_dir), tmp_path / "universal", to="universal", progress=False)
    assert "\n" not in str(error.value) and not (tmp_path / "universal").exists()


def test_a_state_file_lost_from_a_universal_checkpoint_is_named(sgd_checkpoint, tmp_path):
    from deepspeed_ext.api import convert
    from deepspeed_ext.checkpoint.deepspeed import DeepSpeedCheckpoint
    from deepspeed_ext.checkpoint.universal import UniversalCheckpoint
    save_dir, plan = sgd_checkpoint
    out = convert(DeepSpeedCheckpoint(save_dir), tmp_path / "universal", to="universal", progress=False)
    (out / "zero" / plan.params[-1].name / "momentum_buffer.pt").unlink()
    with pytest.raises(CheckpointError, match="momentum_buffer.pt: missing"):
        list(UniversalCheckpoint(out).tensors())


def test_a_universal_checkpoint_with_its_step_only_in_the_optimizer_summary_carries_it(tmp_path):
    """Upstream's ZeRO-3 output keeps the step in ``zero/optimizer_state.pt`` alone (no ``step.pt``): every
    parameter with optimizer states still has it, as its scalar state."""
    sys.path.insert(0, str(ROOT / "bench"))
    import synth_checkpoint

    from deepspeed_ext.api import convert
    from deepspeed_ext.checkpoint.deepspeed import DeepSpeedCheckpoint
    from deepspeed_ext.checkpoint.universal import UniversalCheckpoint
    plan = synth_checkpoint.make_plan(synth_checkpoint.llama_config_dict(TINY), tp=2)
    synth_checkpoint.write_checkpoint(plan, tmp_path / "ckpt", log=False)
    out = convert(DeepSpeedCheckpoint(tmp_path / "ckpt"), tmp_path / "universal", to="universal", progress=False)
    step = int(serialization.load(out / "zero" / plan.params[0].name / "step.pt"))
    for path in (out / "zero").glob("*/step.pt"):
        path.unlink()
    summary = out / "zero" / "optimizer_state.pt"
    serialization.save({**serialization.load(summary),
                        keys.OPTIMIZER_STATE_DICT: {keys.STATE: {0: {"step": step}}, keys.PARAM_GROUPS: []}}, summary)
    universal = UniversalCheckpoint(out)
    for param in plan.params:
        assert universal.states_of(param.name) == (("fp32", "exp_avg", "exp_avg_sq"), ("step", ))
        assert int(universal.scalar(param.name, "step")) == step
