"""AutoTP presets for transformers model types outside the family registry: their tp_plan in DeepSpeed's terms."""

from __future__ import annotations

import re

import pytest

import deepspeed_ext
from deepspeed_ext.errors import CheckpointError
from deepspeed_ext.presets import partition_config_from_tp_plan


def specs_for(preset: dict, name: str) -> list[dict]:
    return [spec for spec in preset["partition_config"]["layer_specs"]
            if any(re.match(pattern, name) for pattern in spec["patterns"])]


def test_split_styles_split_and_every_other_style_stays_whole():
    preset = partition_config_from_tp_plan({
        "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
        "layers.*.linear_attn.in_proj_qkvz": "colwise_gather_output", "layers.*.mlp.experts": "moe_tp_experts"})
    assert preset["partition_config"]["use_default_specs"] is False

    def kind(name: str) -> tuple:
        (spec, ) = specs_for(preset, name)
        return spec["partition_type"], spec.get("grad_allreduce", False), spec.get("gather_output", False)

    assert kind("model.layers.11.self_attn.q_proj.weight") == ("column", False, False)
    assert kind("base_model.model.model.layers.0.self_attn.o_proj.weight") == ("row", False, False)
    assert kind("layers.3.self_attn.q_norm.weight") == ("skip", True, False)
    assert kind("model.layers.0.linear_attn.in_proj_qkvz.weight") == ("skip", False, False)
    assert kind("lm_head.weight") == ("column", False, True)
    assert not specs_for(preset, "model.layers.0.self_attn.q_proj_extra.weight")


@pytest.mark.parametrize("model_type, split, whole", [
    ("ernie4_5_moe", ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.shared_experts.down_proj.weight"],
     []),
    ("olmo2", ["model.layers.0.mlp.up_proj.weight"], ["model.layers.0.self_attn.q_proj.weight"]),
    ("exaone4", ["model.layers.0.self_attn.o_proj.weight"], ["model.layers.0.self_attn.q_norm.weight"]),
])
def test_a_transformers_model_type_gets_its_plan_translated(model_type, split, whole):
    preset = deepspeed_ext.tensor_parallel_preset(model_type)
    for name in split:
        assert specs_for(preset, name)[0]["partition_type"] in ("column", "row"), name
    for name in whole:
        assert specs_for(preset, name)[0]["partition_type"] == "skip", name


def test_registry_families_keep_their_own_preset_and_unknown_names_get_one_line():
    assert deepspeed_ext.tensor_parallel_preset("qwen3_moe") == deepspeed_ext.tensor_parallel_preset("qwen3-moe")
    # A registry family is found by its HF model_type too, and keeps its own preset (GLM-4.5's splits its dense MLPs).
    glm = deepspeed_ext.tensor_parallel_preset("glm4_moe")
    assert glm == deepspeed_ext.tensor_parallel_preset("glm-4.5")
    assert specs_for(glm, "model.layers.0.mlp.gate_proj.weight")[0]["partition_type"] == "column"
    with pytest.raises(CheckpointError, match="neither a deepspeed-ext family .* nor a transformers model_type"):
        deepspeed_ext.tensor_parallel_preset("no_such_model")
