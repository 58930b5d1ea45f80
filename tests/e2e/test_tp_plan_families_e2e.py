"""Model types deepspeed-ext has no family for (ERNIE 4.5 MoE, EXAONE 4), trained with AutoTP through the
preset translated from their transformers tp_plan: TP=2 trains the model TP=1 trains (fp32, within 1e-5 after 3
steps: no gradient lost its sum), splitting what the plan splits."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from harness.runner import run_logged

WORKER = Path(__file__).resolve().parents[1] / "harness" / "workers" / "tp_plan_family.py"


def trained(model_type: str, tp: int, tmp_path: Path) -> dict:
    result = tmp_path / f"{model_type}_tp{tp}.json"
    run_logged([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={tp}", str(WORKER),
                model_type, str(tp), str(result)], result.with_suffix(".log"))
    return json.loads(result.read_text())


@pytest.mark.parametrize("model_type, split", [
    ("ernie4_5_moe", {"model.layers.*.self_attn.q_proj.weight", "model.layers.*.self_attn.o_proj.weight",
                      "model.layers.*.mlp.down_proj.weight", "model.layers.*.mlp.shared_experts.up_proj.weight"}),
    ("exaone4", {"model.layers.*.mlp.gate_proj.weight", "model.layers.*.self_attn.q_proj.weight", "lm_head.weight"}),
])
def test_tp2_trains_as_tp1_with_the_translated_plan(model_type, split, tmp_path):
    whole, cut = trained(model_type, 1, tmp_path), trained(model_type, 2, tmp_path)
    assert split <= set(cut["split"]), cut["split"]
    assert all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(whole["losses"], cut["losses"], strict=True)), (
        whole["losses"], cut["losses"])
