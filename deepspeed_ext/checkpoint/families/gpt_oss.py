"""gpt-oss (MaxText decoder_block "gpt_oss"): attention with biases and per-head sinks, a routed expert block
with biases, local (sliding) and global layers alternating.

transformers holds the experts as MaxText does, input-major: ``experts.gate_up_proj`` [E, H, 2I] with the
gate and up columns interleaved (even = gate, odd = up; the same in ``gate_up_proj_bias`` [E, 2I]) and
``experts.down_proj`` [E, I, H]; the files use the model's names. MaxText splits gate and up into ``wi_0`` /
``wi_1`` (and their biases) and, scanned, keeps one stack per position in its two-layer cycle
(``layers/layers_0`` = layers 0, 2, 4, ...; ``layers/layers_1`` = 1, 3, 5, ...).
"""

from collections.abc import Mapping
from functools import partial
from typing import Any

from deepspeed_ext.checkpoint.families import Family, Rule, cycle_blocks, num_experts
from deepspeed_ext.checkpoint.families.llama import EMBEDDING_AND_NORM, LM_HEAD

_L = "model.layers.{layer}"
_A = "decoder/{layers}/GptOssAttention"
_M = "decoder/{layers}/GptOssMlp"
LAYER_RULES = (
    Rule(f"{_L}.input_layernorm.weight", "decoder/{layers}/pre_self_attention_layer_norm/scale", "copy"),
    Rule(f"{_L}.self_attn.q_proj.weight", f"{_A}/query/kernel", "query"),
    Rule(f"{_L}.self_attn.q_proj.bias", f"{_A}/query/bias", "query_bias"),
    Rule(f"{_L}.self_attn.k_proj.weight", f"{_A}/key/kernel", "key"),
    Rule(f"{_L}.self_attn.k_proj.bias", f"{_A}/key/bias", "key_bias"),
    Rule(f"{_L}.self_attn.v_proj.weight", f"{_A}/value/kernel", "value"),
    Rule(f"{_L}.self_attn.v_proj.bias", f"{_A}/value/bias", "value_bias"),
    Rule(f"{_L}.self_attn.o_proj.weight", f"{_A}/out/kernel", "out"),
    Rule(f"{_L}.self_attn.o_proj.bias", f"{_A}/out/bias", "copy"),
    Rule(f"{_L}.self_attn.sinks", f"{_A}/sinks", "copy"),
    Rule(f"{_L}.post_attention_layernorm.weight", "decoder/{layers}/post_self_attention_layer_norm/scale", "copy"),
    Rule(f"{_L}.mlp.router.weight", f"{_M}/gate/kernel", "linear"),
    Rule(f"{_L}.mlp.router.bias", f"{_M}/gate/bias", "copy"),
    Rule(f"{_L}.mlp.experts.gate_up_proj", f"{_M}/wi_0", "even_columns"),
    Rule(f"{_L}.mlp.experts.gate_up_proj", f"{_M}/wi_1", "odd_columns"),
    Rule(f"{_L}.mlp.experts.gate_up_proj_bias", f"{_M}/wi_0_bias", "even_columns"),
    Rule(f"{_L}.mlp.experts.gate_up_proj_bias", f"{_M}/wi_1_bias", "odd_columns"),
    Rule(f"{_L}.mlp.experts.down_proj", f"{_M}/wo", "copy"),
    Rule(f"{_L}.mlp.experts.down_proj_bias", f"{_M}/wo_bias", "copy"),
)


def _maxtext_extra(c: Mapping[str, Any]) -> dict[str, Any]:
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    settings: dict[str, Any] = {
        "num_experts": num_experts(c), "num_experts_per_tok": c["num_experts_per_tok"],
        "base_moe_mlp_dim": c["intermediate_size"], "sliding_window_size": c.get("sliding_window") or 0,
        "mlp_activations_limit": c.get("swiglu_limit", 7.0), "max_position_embeddings": c.get("max_position_embeddings"),
    }
    if rope.get("rope_type") == "yarn":
        settings.update(rope_factor=rope.get("factor"), beta_fast=rope.get("beta_fast"), beta_slow=rope.get("beta_slow"),
                        original_max_position_embeddings=rope.get("original_max_position_embeddings"),
                        rope_truncate=bool(rope.get("truncate", True)))
    return {key: value for key, value in settings.items() if value is not None}


GPT_OSS = Family(name="gpt-oss",
                 model_type="gpt_oss",
                 rules=EMBEDDING_AND_NORM + LAYER_RULES,
                 untied_rules=LM_HEAD,
                 query_scaled=False,
                 rope_interleaved=False,
                 maxtext_model="gpt-oss-20b",
                 maxtext_extra=_maxtext_extra,
                 layer_blocks=partial(cycle_blocks, cycle=2, remainder=None))

FAMILIES = (GPT_OSS, )
