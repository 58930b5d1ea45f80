"""DeepSeek-V3 (MaxText decoder_block "deepseek", model deepseek3-671b): multi-head latent attention, the first
``first_k_dense_replace`` layers dense and the rest mixture-of-experts with shared experts and a router bias.

MaxText keeps the two kinds of layers apart: ``dense_layers`` and ``moe_layers`` (scanned, each a stack) or
``dense_layers_<i>`` / ``moe_layers_<j>`` (j counts MoE layers from 0). Attention: the low-rank A projections
are plain kernels; the B projections and the output are split per head ([Q, N, dn+dr], [C, N, dn+dv],
[N, dv, H]); the query is scaled at run time. RoPE needs no permutation: transformers' ``rope_interleave``
and MaxText consume the rotary dims the same way. The router's ``e_score_correction_bias`` (a buffer in
transformers, not trained by the optimizer) lives in MaxText's ``MoEBiasVar`` collection, stacked on axis 0
when scanned. transformers 5 holds the routed experts fused, [E, 2I, H] and [E, H, I]; its files write them
one by one (``mlp.experts.<e>.gate_proj.weight``, ...), as for Qwen3-MoE.
"""

from collections.abc import Mapping
from typing import Any

from deepspeed_ext.checkpoint.families import Family, LayerBlock, Rule, num_experts, partition_config
from deepspeed_ext.checkpoint.families.llama import EMBEDDING_AND_NORM, HEAD_SPEC, LM_HEAD, mlp_specs
from deepspeed_ext.checkpoint.families.qwen3_moe import HF_EXPERTS

_L = "model.layers.{layer}"
_A = "decoder/{layers}/self_attention"
_M = "decoder/{layers}/DeepSeekMoeBlock_0"
ATTENTION = (
    Rule(f"{_L}.input_layernorm.weight", "decoder/{layers}/pre_self_attention_layer_norm/scale", "copy"),
    Rule(f"{_L}.self_attn.q_a_proj.weight", f"{_A}/wq_a/kernel", "linear"),
    Rule(f"{_L}.self_attn.q_a_layernorm.weight", f"{_A}/q_norm/scale", "copy"),
    Rule(f"{_L}.self_attn.q_b_proj.weight", f"{_A}/wq_b/kernel", "head_rows"),
    Rule(f"{_L}.self_attn.kv_a_proj_with_mqa.weight", f"{_A}/wkv_a/kernel", "linear"),
    Rule(f"{_L}.self_attn.kv_a_layernorm.weight", f"{_A}/kv_norm/scale", "copy"),
    Rule(f"{_L}.self_attn.kv_b_proj.weight", f"{_A}/wkv_b/kernel", "head_rows"),
    Rule(f"{_L}.self_attn.o_proj.weight", f"{_A}/out/kernel", "head_columns"),
    Rule(f"{_L}.post_attention_layernorm.weight", "decoder/{layers}/post_self_attention_layer_norm/scale", "copy"),
)
DENSE_MLP = (
    Rule(f"{_L}.mlp.gate_proj.weight", "decoder/{layers}/mlp/wi_0/kernel", "linear", block="dense"),
    Rule(f"{_L}.mlp.up_proj.weight", "decoder/{layers}/mlp/wi_1/kernel", "linear", block="dense"),
    Rule(f"{_L}.mlp.down_proj.weight", "decoder/{layers}/mlp/wo/kernel", "linear", block="dense"),
)
MOE = (
    Rule(f"{_L}.mlp.gate.weight", f"{_M}/MoeBlock_0/gate/kernel", "linear", block="moe"),
    Rule(f"{_L}.mlp.gate.e_score_correction_bias", f"{_M}/MoeBlock_0/gate/bias", "copy", block="moe",
         collection="MoEBiasVar", scan_axis=0),
    Rule(f"{_L}.mlp.experts.gate_up_proj", f"{_M}/MoeBlock_0/wi_0", "expert_gate", block="moe"),
    Rule(f"{_L}.mlp.experts.gate_up_proj", f"{_M}/MoeBlock_0/wi_1", "expert_up", block="moe"),
    Rule(f"{_L}.mlp.experts.down_proj", f"{_M}/MoeBlock_0/wo", "expert_down", block="moe"),
    Rule(f"{_L}.mlp.shared_experts.gate_proj.weight", f"{_M}/shared_experts/wi_0/kernel", "linear", block="moe"),
    Rule(f"{_L}.mlp.shared_experts.up_proj.weight", f"{_M}/shared_experts/wi_1/kernel", "linear", block="moe"),
    Rule(f"{_L}.mlp.shared_experts.down_proj.weight", f"{_M}/shared_experts/wo/kernel", "linear", block="moe"),
)


def _blocks(config: Mapping[str, Any], scanned: bool) -> tuple[LayerBlock, ...]:
    layers = int(config["num_hidden_layers"])
    dense = min(int(config.get("first_k_dense_replace", 0) or 0), layers)
    if scanned:
        return tuple(block for block in (LayerBlock("dense_layers", tuple(range(dense)), True, "dense"),
                                         LayerBlock("moe_layers", tuple(range(dense, layers)), True, "moe"))
                     if block.layers)
    return (tuple(LayerBlock(f"dense_layers_{i}", (i, ), False, "dense") for i in range(dense)) +
            tuple(LayerBlock(f"moe_layers_{i - dense}", (i, ), False, "moe") for i in range(dense, layers)))


def _maxtext_extra(c: Mapping[str, Any]) -> dict[str, Any]:
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    settings: dict[str, Any] = {
        "base_moe_mlp_dim": c["moe_intermediate_size"], "first_num_dense_layers": c.get("first_k_dense_replace", 0),
        "num_experts": num_experts(c), "num_experts_per_tok": c["num_experts_per_tok"],
        "shared_experts": c.get("n_shared_experts", 0), "routed_scaling_factor": c.get("routed_scaling_factor", 1.0),
        "q_lora_rank": c.get("q_lora_rank") or 0, "kv_lora_rank": c["kv_lora_rank"],
        "qk_nope_head_dim": c["qk_nope_head_dim"], "qk_rope_head_dim": c["qk_rope_head_dim"],
        "v_head_dim": c["v_head_dim"], "n_routing_groups": c.get("n_group") or -1,
        "topk_routing_group": c.get("topk_group") or -1,
    }
    # MaxText's MLA reads rotary dims in transformers' interleaved order only on its yarn path; yarn with
    # factor 1 and no context extension is exactly plain RoPE.
    if rope.get("rope_type", "default") == "yarn":
        settings.update(rope_type="yarn", rope_factor=rope.get("factor", 1.0), beta_fast=rope.get("beta_fast", 32),
                        beta_slow=rope.get("beta_slow", 1), mscale=rope.get("mscale_all_dim") or rope.get("mscale", 1.0),
                        original_max_position_embeddings=rope.get("original_max_position_embeddings"),
                        max_position_embeddings=c.get("max_position_embeddings"))
    else:
        length = c.get("max_position_embeddings")
        settings.update(rope_type="yarn", rope_factor=1, original_max_position_embeddings=length,
                        max_position_embeddings=length)
    return {key: value for key, value in settings.items() if value is not None}


#: AutoTP for DeepSeek-V3: DeepSpeed refuses transformers' tp_plan for it ("packed_colwise", "moe_tp_experts").
#: The dense MLPs and the shared experts are split (column, then row) and lm_head by vocabulary. Attention
#: stays whole: the rotary key (the last qk_rope_head_dim outputs of kv_a_proj_with_mqa) is shared by every
#: head and reaches attention without passing a column-parallel layer, so with heads split each rank would get
#: a partial gradient for it and for the residual stream. The fused experts and the router stay whole too.
TENSOR_PARALLEL = partition_config(*mlp_specs(r"mlp\.(shared_experts\.)?"), HEAD_SPEC)

DEEPSEEK_V3 = Family(name="deepseek-v3",
                     model_type="deepseek_v3",
                     rules=EMBEDDING_AND_NORM + ATTENTION + DENSE_MLP + MOE,
                     untied_rules=LM_HEAD,
                     query_scaled=False,
                     rope_interleaved=False,
                     maxtext_model="deepseek3-671b",
                     maxtext_extra=_maxtext_extra,
                     layer_blocks=_blocks,
                     hf_expert_splits=HF_EXPERTS,
                     tensor_parallel=TENSOR_PARALLEL,
                     expert_parallel="deepseek_v3")

FAMILIES = (DEEPSEEK_V3, )
