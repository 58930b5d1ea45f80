"""Any optimizer DeepSpeed runs, not just Adam, on the real engine: DeepSpeed's Muon (a momentum for the matrices,
Adam's moments for embeddings, norms and the head; under ZeRO-1/2 the momentum of whole parameters per partition),
a client ``torch.optim.SGD`` with momentum, and DeepSpeed's Adagrad. Each is trained at TP=2 with 2 KV heads,
converted, compared bit for bit with what the live optimizer held, and resumed at TP=1 and TP=3 (a rank beyond the
KV-head count) from the universal form and directly, where the next loss continues the uninterrupted run's."""

import json

import pytest
import torch

from deepspeed_ext.checkpoint.deepspeed import DeepSpeedCheckpoint
from harness.runner import cli
from harness.scenario import Load, assert_universal_matches_live

#: What ``inspect`` shows of each optimizer's states (sets of states, and how many of the 21 parameters have each).
STATES = {
    "muon": {"fp32/momentum_buffer": 14, "fp32/exp_avg/exp_avg_sq/step": 7},
    "sgd": {"fp32/momentum_buffer": 21},
    "adagrad": {"fp32/sum/step": 21},
}
#: Per optimizer: the TP-local tensor states compared with the live engine's, over both TP ranks.
COMPARED = {"muon": (14 * 2 + 7 * 3) * 2, "sgd": 21 * 2 * 2, "adagrad": 21 * 2 * 2}


@pytest.fixture(scope="module")
def muon(scenarios):
    # DP=2: each DP rank's Muon momentum holds the whole matrices of its partition, one split between the two on both.
    return scenarios("kv2_tp2_dp2_muon", tp=2, dp=2, kv_heads=2, optimizer="muon")


@pytest.fixture(scope="module")
def sgd(scenarios):
    return scenarios("kv2_tp2_sgd", tp=2, kv_heads=2, optimizer="sgd")


@pytest.fixture(scope="module")
def adagrad(scenarios):
    return scenarios("kv2_tp2_adagrad", tp=2, kv_heads=2, optimizer="adagrad")


@pytest.mark.parametrize("optimizer", ["muon", "sgd", "adagrad"])
def test_merged_states_equal_the_live_engine(request, optimizer, tmp_path):
    scenario = request.getfixturevalue(optimizer)
    summary = json.loads(cli(["inspect", str(scenario.tag_dir), "--json"], tmp_path / "inspect.log").stdout)
    assert summary["optimizer_states"] == STATES[optimizer]
    assert assert_universal_matches_live(scenario) == COMPARED[optimizer]


def _merged_live(scenario) -> dict[str, dict[str, torch.Tensor]]:
    """The live engine's state at save time, merged over its TP ranks."""
    layouts = DeepSpeedCheckpoint(scenario.tag_dir).layouts
    live = scenario.live_state()
    return {name: {state: layout.merge([live[rank][name][state] for rank in range(scenario.tp)])
                   for state in live[0][name]} for name, layout in layouts.items()}


@pytest.mark.parametrize("optimizer,tp", [("muon", 1), ("muon", 3), ("sgd", 1), ("sgd", 3), ("adagrad", 1)])
def test_resumes_at_another_tp_from_the_universal_form_and_directly(request, optimizer, tp):
    """The next loss is the uninterrupted run's (within 2e-3); the direct load restores every state bit for bit
    as loading the universal form does; at TP=1 that is the live engine's state at save time, merged (the resume
    also checked every state against the saved fingerprints, or it would have stopped)."""
    scenario = request.getfixturevalue(optimizer)
    (direct, direct_losses), (converted, converted_losses) = scenario.loaded_many(
        [Load(tp, 1, scenario.tag_dir, load_universal=False), Load(tp, 1, scenario.universal_dir)])
    step = scenario.save_at + 1
    for losses in (direct_losses, converted_losses):
        assert abs(losses[step] - scenario.baseline[step]) <= 2e-3 * abs(scenario.baseline[step]), (losses, step)
    for rank in range(tp):
        for name, states in converted[rank].items():
            assert sorted(direct[rank][name]) == sorted(states), name
            for state, value in states.items():
                assert torch.equal(direct[rank][name][state], value), f"TP rank {rank}: {name}/{state}"
    if tp == 1:
        for name, states in _merged_live(scenario).items():
            assert sorted(converted[0][name]) == sorted(states), name
            for state, value in states.items():
                # DeepSpeed's Muon keeps its ZeRO-1/2 momentum in the gradients' bf16; a restore hands it over in
                # fp32, which DeepSpeed casts back at its first use: the values are the same.
                restored = converted[0][name][state]
                assert torch.equal(restored.to(value.dtype), value) and torch.equal(restored.float(), value.float()), \
                    f"{name}/{state}"
