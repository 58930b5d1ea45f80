"""The hybrid Qwen families: Qwen3-Next (HF ``qwen3_next``), Qwen3.5 dense (``qwen3_5_text``) and Qwen3.5-MoE
(``qwen3_5_moe_text``). ``layer_types`` interleaves gated-DeltaNet linear-attention layers (``linear_attn``) with
gated full attention (``self_attn``: q_proj yields each head's query and its output gate side by side; per-head q/k
norms; partial rotary). Qwen3-Next fuses the DeltaNet input projections per key head (``in_proj_qkvz``,
``in_proj_ba``), Qwen3.5 keeps them apart (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``). The MoE
members add one shared expert behind a sigmoid gate (``shared_expert_gate``) to the routed experts; transformers
holds those fused and its files write them one by one.

The MoE members go to MaxText's ``qwen3-next-80b-a3b`` (decoder_block "qwen3_next") and ``qwen3.5-35b-a3b``
("qwen3_5", text only, its multimodal RoPE off: text positions make it plain RoPE). Both build every layer as
MaxText's pattern says: full attention at the end of every cycle of ``inhomogeneous_layer_cycle_interval`` layers,
gated DeltaNet elsewhere, and an MoE block everywhere (its shared expert as wide as a routed one). The full
attention's query kernel is ``[embed, heads, 2 * head_dim]`` (query, then gate, per head), its output kernel plain
``[heads * head_dim, embed]``; the DeltaNet's ``in_proj_qkvz`` / ``in_proj_ba`` kernels are grouped per key head as
Qwen3-Next's HF projections are (Qwen3.5's four are fused into them), its convolution kernel ``[width, 1,
channels]``. Norm scales are stored as w (MaxText adds the 1 at run time, as transformers does).

Scanned, Qwen3.5 stacks one layer per position in the cycle (``layers/layer_<j>``, whole cycles only: MaxText
drops the layers past the last whole cycle). Qwen3-Next nests scans: per cycle, its full-attention layer
(``layers/global_layer``, stacked over the cycles) and its linear-attention layers (``layers/local_layers``, stacked
over cycles x positions on axes 1 and 2); the layers past the last whole cycle are linear (``layers_remainder/
local_layers``). MaxText has no dense Qwen3.5 model.
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

from deepspeed_ext.checkpoint.families import Family, LayerBlock, Rule, num_experts, partition_config
from deepspeed_ext.checkpoint.families.llama import (
    ATTENTION_AND_HEAD_SPECS,
    EMBEDDING_AND_NORM,
    LM_HEAD,
    QK_NORM_SPEC,
    mlp_specs,
)
from deepspeed_ext.checkpoint.families.qwen3_moe import HF_EXPERTS
from deepspeed_ext.errors import CheckpointError

#: AutoTP for the hybrid Qwen families: DeepSpeed refuses transformers' plan ("colwise_gather_output" on the DeltaNet
#: projections, "packed_colwise", "moe_tp_experts"). Full attention is split by heads (a head's query and gate rows
#: are adjacent, so they stay together), its per-head q/k norms whole with their gradients summed over TP; the dense
#: MLPs and the shared experts are split. The DeltaNet layers, the shared-expert gate, the router and the fused
#: experts stay whole.
TENSOR_PARALLEL = partition_config(*ATTENTION_AND_HEAD_SPECS, *mlp_specs(r"mlp\.(shared_expert\.)?"), QK_NORM_SPEC)

#: AutoEP holds the block's one shared expert and its gate as ``shared_experts`` / ``shared_experts_gate``.
AUTOEP_RENAMED = tuple((f"shared_experts.{p}_proj.weight", f"shared_expert.{p}_proj.weight")
                       for p in ("gate", "up", "down")) + (("shared_experts_gate.weight", "shared_expert_gate.weight"), )

_L = "model.layers.{layer}"
_M = "decoder/{layers}"
_A = f"{_M}/attention/attention"  # the gated full attention
_D = f"{_M}/attention"  # the gated DeltaNet
_E = f"{_M}/mlp"
LAYER_NORMS = (
    Rule(f"{_L}.input_layernorm.weight", f"{_M}/input_layernorm/scale", "copy"),
    Rule(f"{_L}.post_attention_layernorm.weight", f"{_M}/post_attention_layernorm/scale", "copy"),
)
FULL_ATTENTION = (
    Rule(f"{_L}.self_attn.q_proj.weight", f"{_A}/query/kernel", "head_rows", block="full"),
    Rule(f"{_L}.self_attn.k_proj.weight", f"{_A}/key/kernel", "key", block="full"),
    Rule(f"{_L}.self_attn.v_proj.weight", f"{_A}/value/kernel", "value", block="full"),
    Rule(f"{_L}.self_attn.o_proj.weight", f"{_A}/out/kernel", "linear", block="full"),
    Rule(f"{_L}.self_attn.q_norm.weight", f"{_A}/query_norm/scale", "copy", block="full"),
    Rule(f"{_L}.self_attn.k_norm.weight", f"{_A}/key_norm/scale", "copy", block="full"),
)
DELTANET = (
    Rule(f"{_L}.linear_attn.conv1d.weight", f"{_D}/conv1d/kernel", "conv_kernel", block="linear"),
    Rule(f"{_L}.linear_attn.A_log", f"{_D}/A_log", "copy", block="linear"),
    Rule(f"{_L}.linear_attn.dt_bias", f"{_D}/dt_bias", "copy", block="linear"),
    Rule(f"{_L}.linear_attn.norm.weight", f"{_D}/norm/rms_norm/scale", "copy", block="linear"),
    Rule(f"{_L}.linear_attn.out_proj.weight", f"{_D}/out_proj/kernel", "linear", block="linear"),
)
#: Qwen3-Next's projections are MaxText's layout already (grouped per key head), transposed.
NEXT_PROJECTIONS = (
    Rule(f"{_L}.linear_attn.in_proj_qkvz.weight", f"{_D}/in_proj_qkvz/kernel", "linear", block="linear"),
    Rule(f"{_L}.linear_attn.in_proj_ba.weight", f"{_D}/in_proj_ba/kernel", "linear", block="linear"),
)
#: Qwen3.5's four, fused into MaxText's two.
QWEN35_PROJECTIONS = (
    Rule(f"{_L}.linear_attn.in_proj_qkv.weight", f"{_D}/in_proj_qkvz/kernel", "deltanet_qkvz", block="linear",
         fused=(f"{_L}.linear_attn.in_proj_z.weight", )),
    Rule(f"{_L}.linear_attn.in_proj_b.weight", f"{_D}/in_proj_ba/kernel", "deltanet_ba", block="linear",
         fused=(f"{_L}.linear_attn.in_proj_a.weight", )),
)
MOE_BLOCK = (
    Rule(f"{_L}.mlp.gate.weight", f"{_E}/routed_experts/gate/kernel", "linear"),
    Rule(f"{_L}.mlp.experts.gate_up_proj", f"{_E}/routed_experts/wi_0", "expert_gate"),
    Rule(f"{_L}.mlp.experts.gate_up_proj", f"{_E}/routed_experts/wi_1", "expert_up"),
    Rule(f"{_L}.mlp.experts.down_proj", f"{_E}/routed_experts/wo", "expert_down"),
    Rule(f"{_L}.mlp.shared_expert.gate_proj.weight", f"{_E}/shared_expert/wi_0/kernel", "linear"),
    Rule(f"{_L}.mlp.shared_expert.up_proj.weight", f"{_E}/shared_expert/wi_1/kernel", "linear"),
    Rule(f"{_L}.mlp.shared_expert.down_proj.weight", f"{_E}/shared_expert/wo/kernel", "linear"),
    Rule(f"{_L}.mlp.shared_expert_gate.weight", f"{_E}/shared_expert_gate/kernel", "linear"),
)
COMMON_RULES = EMBEDDING_AND_NORM + LAYER_NORMS + FULL_ATTENTION + DELTANET + MOE_BLOCK


def _cycle(config: Mapping[str, Any]) -> int:
    """MaxText's inhomogeneous_layer_cycle_interval: full attention ends every cycle, the rest is linear. A model
    too shallow for a full-attention layer reads as one cycle longer than itself (MaxText builds the same)."""
    num_layers = int(config["num_hidden_layers"])
    types = list(config.get("layer_types") or [])
    interval = int(config.get("full_attention_interval") or 4)  # transformers' default, where layer_types is not
    if "full_attention" in types:
        cycle = types.index("full_attention") + 1
    else:
        cycle = interval if interval > num_layers or not types else num_layers + 1
    expected = ["full_attention" if (i + 1) % cycle == 0 else "linear_attention" for i in range(num_layers)]
    if types and types != expected:
        raise CheckpointError(f"layer_types {types} are not MaxText's pattern (full attention ending every cycle of "
                              f"{cycle} layers, gated DeltaNet elsewhere)")
    return cycle


def _kind(layer: int, cycle: int) -> str:
    return "full" if (layer + 1) % cycle == 0 else "linear"


def _unscanned(config: Mapping[str, Any]) -> tuple[LayerBlock, ...]:
    cycle = _cycle(config)
    return tuple(LayerBlock(f"layers_{i}", (i, ), False, _kind(i, cycle))
                 for i in range(int(config["num_hidden_layers"])))


def _qwen35_blocks(config: Mapping[str, Any], scanned: bool) -> tuple[LayerBlock, ...]:
    """Scanned: ``layers/layer_<j>`` stacks layers j, j + cycle, ... (whole cycles only); else ``layers_<i>``."""
    if not scanned:
        return _unscanned(config)
    num_layers, cycle = int(config["num_hidden_layers"]), _cycle(config)
    if num_layers % cycle:
        raise CheckpointError(f"{num_layers} decoder layers are not whole cycles of {cycle}, which scanned MaxText "
                              f"needs for this family; write it with --no-scan-layers")
    return tuple(LayerBlock(f"layers/layer_{j}", tuple(range(j, num_layers, cycle)), True, _kind(j, cycle))
                 for j in range(cycle))


def _next_blocks(config: Mapping[str, Any], scanned: bool) -> tuple[LayerBlock, ...]:
    """Scanned: per whole cycle, the full-attention layer (``layers/global_layer``) and the linear ones
    (``layers/local_layers``: cycles x positions); the linear layers left over in ``layers_remainder/local_layers``.
    Else ``layers_<i>``."""
    if not scanned:
        return _unscanned(config)
    num_layers, cycle = int(config["num_hidden_layers"]), _cycle(config)
    cycles, left = divmod(num_layers, cycle)
    blocks = []
    if cycles:
        local = tuple(c * cycle + p for c in range(cycles) for p in range(cycle - 1))
        blocks += [LayerBlock("layers/global_layer", tuple(range(cycle - 1, num_layers, cycle)), True, "full"),
                   LayerBlock("layers/local_layers", local, True, "linear", stack=(cycles, cycle - 1))]
    if left:
        blocks.append(LayerBlock("layers_remainder/local_layers", tuple(range(cycles * cycle, num_layers)), True,
                                 "linear"))
    return tuple(blocks)


def _maxtext_extra(c: Mapping[str, Any]) -> dict[str, Any]:
    """The hybrid layers' sizes and switches; refuses what MaxText's decoder cannot build."""
    routed, shared = c.get("moe_intermediate_size"), c.get("shared_expert_intermediate_size")
    if shared != routed:
        raise CheckpointError(f"MaxText's shared expert is as wide as a routed one (moe_intermediate_size {routed}), "
                              f"not shared_expert_intermediate_size {shared}")
    if int(c.get("decoder_sparse_step") or 1) != 1 or c.get("mlp_only_layers"):
        raise CheckpointError("MaxText builds an MoE block in every layer: decoder_sparse_step must be 1 and "
                              "mlp_only_layers empty")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if rope.get("rope_type", "default") != "default":
        raise CheckpointError(f"RoPE type {rope.get('rope_type')!r} has no MaxText setting for this family")
    return {"base_mlp_dim": routed, "base_moe_mlp_dim": routed, "num_experts": num_experts(c),
            "num_experts_per_tok": c["num_experts_per_tok"], "shared_experts": 1,
            "norm_topk_prob": bool(c.get("norm_topk_prob", True)), "inhomogeneous_layer_cycle_interval": _cycle(c),
            "gdn_conv_kernel_dim": c["linear_conv_kernel_dim"], "gdn_key_head_dim": c["linear_key_head_dim"],
            "gdn_value_head_dim": c["linear_value_head_dim"], "gdn_num_key_heads": c["linear_num_key_heads"],
            "gdn_num_value_heads": c["linear_num_value_heads"], "use_qk_norm": False,
            "partial_rotary_factor": rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))}


QWEN35 = Family(name="qwen3.5",
                model_type="qwen3_5_text",
                rules=(),
                query_scaled=False,
                rope_interleaved=False,
                maxtext_model=None,
                maxtext_note="MaxText 0.2.5 has no dense Qwen3.5 model: its qwen3_5 decoder layer always builds the "
                             "MoE block",
                tensor_parallel=TENSOR_PARALLEL)

QWEN35_MOE = dataclasses.replace(QWEN35, name="qwen3.5-moe", model_type="qwen3_5_moe_text",
                                 rules=COMMON_RULES + QWEN35_PROJECTIONS, untied_rules=LM_HEAD,
                                 maxtext_model="qwen3.5-35b-a3b", maxtext_note="",
                                 maxtext_extra=lambda c: {**_maxtext_extra(c), "use_mrope": False},
                                 layer_blocks=_qwen35_blocks, hf_expert_splits=HF_EXPERTS,
                                 expert_parallel="qwen3_5_moe", autoep_renamed=AUTOEP_RENAMED)

# Qwen3.5-MoE's block, the fused DeltaNet projections apart: AutoEP's qwen3_5_moe preset (a softmax router, fused
# experts, one shared expert behind its gate) fits it too.
QWEN3_NEXT = dataclasses.replace(QWEN35_MOE, name="qwen3-next", model_type="qwen3_next",
                                 rules=COMMON_RULES + NEXT_PROJECTIONS, maxtext_model="qwen3-next-80b-a3b",
                                 maxtext_extra=_maxtext_extra, layer_blocks=_next_blocks)

FAMILIES = (QWEN35, QWEN35_MOE, QWEN3_NEXT)
