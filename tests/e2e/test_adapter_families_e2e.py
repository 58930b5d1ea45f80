"""Adapters beyond Llama: Qwen3-MoE with LoRA on its attention alone (the experts and router frozen), and Qwen3 with
its tied embedding, trained with DoRA and rsLoRA on every linear layer. Each saved at ZeRO-2 / ZeRO-1 and DP=2: the
PEFT adapter and the merged model have the live model's logits, and a resume at DP=1 restores every state."""

from __future__ import annotations

import json

import pytest

from harness.adapters import assert_every_state_restored, live_logits, logits, merged_loaded, peft_loaded
from harness.runner import cli
from harness.scenario import Load

LOGITS_ATOL = 1e-5
LOSS_RTOL = 2e-3

FAMILIES = {
    "qwen3-moe": dict(zero=2, lora_targets="q_proj,k_proj,v_proj,o_proj"),
    "qwen3": dict(zero=1, lora_options=json.dumps({"use_dora": True, "use_rslora": True})),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def trained(request, scenarios):
    family = request.param
    return scenarios(f"lora_{family}", family=family, tp=1, dp=2, dtype="fp32", lora=4, **FAMILIES[family])


def test_exports_have_the_live_logits(trained, tmp_path):
    live = live_logits(trained)
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    cli(["to-hf", str(trained.tag_dir), "-o", str(adapter), "-q"], tmp_path / "adapter.log")
    config = json.loads((adapter / "adapter_config.json").read_text())
    if trained.family == "qwen3-moe":  # attention alone: nothing of the experts or the router is adapted
        assert sorted(config["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"], config
    else:
        assert config["use_dora"] and config["use_rslora"], config
    assert (logits(peft_loaded(trained, adapter)) - live).abs().max().item() <= LOGITS_ATOL
    cli(["to-hf", str(trained.universal_dir), "-o", str(merged), "--merge", "-q"], tmp_path / "merged.log")
    assert (logits(merged_loaded(merged)) - live).abs().max().item() <= LOGITS_ATOL
    if trained.family == "qwen3":  # tied: one tensor, written once, as save_pretrained writes it
        from safetensors import safe_open
        with safe_open(str(merged / "model.safetensors"), framework="pt") as handle:
            assert "lm_head.weight" not in set(handle.keys())


def test_resume_at_dp1_restores_every_state(trained):
    assert_every_state_restored(trained, [Load(1, 1, trained.universal_dir),
                                          Load(1, 1, trained.tag_dir, load_universal=False)], LOSS_RTOL)
