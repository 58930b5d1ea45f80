"""The hybrid Qwen families: Qwen3-Next (HF ``qwen3_next``), Qwen3.5 dense (``qwen3_5_text``) and Qwen3.5-MoE
(``qwen3_5_moe_text``). ``layer_types`` interleaves gated-DeltaNet linear-attention layers (``linear_attn``) with
gated full attention (``self_attn``: q_proj yields each head's query and its output gate side by side; per-head q/k
norms; partial rotary). Qwen3-Next fuses the DeltaNet input projections per key head (``in_proj_qkvz``,
``in_proj_ba``), Qwen3.5 keeps them apart (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``). The MoE
members add one shared expert behind a sigmoid gate (``shared_expert_gate``) to the routed experts; transformers
holds those fused and its files write them one by one.

MaxText 0.2.5 ships ``qwen3-next-80b-a3b`` and ``qwen3.5-35b-a3b`` / ``-397b-a17b``; deepspeed-ext does not map them
yet.
"""

import dataclasses

from deepspeed_ext.checkpoint.families import Family, partition_config
from deepspeed_ext.checkpoint.families.llama import ATTENTION_AND_HEAD_SPECS, QK_NORM_SPEC, mlp_specs
from deepspeed_ext.checkpoint.families.qwen3_moe import HF_EXPERTS

#: AutoTP for the hybrid Qwen families: DeepSpeed refuses transformers' plan ("colwise_gather_output" on the DeltaNet
#: projections, "packed_colwise", "moe_tp_experts"). Full attention is split by heads (a head's query and gate rows
#: are adjacent, so they stay together), its per-head q/k norms whole with their gradients summed over TP; the dense
#: MLPs and the shared experts are split. The DeltaNet layers, the shared-expert gate, the router and the fused
#: experts stay whole.
TENSOR_PARALLEL = partition_config(*ATTENTION_AND_HEAD_SPECS, *mlp_specs(r"mlp\.(shared_expert\.)?"), QK_NORM_SPEC)

_NOTE = "MaxText 0.2.5 has {}; deepspeed-ext does not map it yet"

#: AutoEP holds the block's one shared expert and its gate as ``shared_experts`` / ``shared_experts_gate``.
AUTOEP_RENAMED = tuple((f"shared_experts.{p}_proj.weight", f"shared_expert.{p}_proj.weight")
                       for p in ("gate", "up", "down")) + (("shared_experts_gate.weight", "shared_expert_gate.weight"), )

QWEN35 = Family(name="qwen3.5",
                model_type="qwen3_5_text",
                rules=(),
                query_scaled=False,
                rope_interleaved=False,
                maxtext_model=None,
                maxtext_note="MaxText 0.2.5 has no dense Qwen3.5 model",
                tensor_parallel=TENSOR_PARALLEL)

QWEN35_MOE = dataclasses.replace(QWEN35, name="qwen3.5-moe", model_type="qwen3_5_moe_text",
                                 maxtext_note=_NOTE.format("qwen3.5-35b-a3b / qwen3.5-397b-a17b"),
                                 hf_expert_splits=HF_EXPERTS, expert_parallel="qwen3_5_moe",
                                 autoep_renamed=AUTOEP_RENAMED)

# Qwen3.5-MoE's block, the fused DeltaNet projections apart: AutoEP's qwen3_5_moe preset (a softmax router, fused
# experts, one shared expert behind its gate) fits it too.
QWEN3_NEXT = dataclasses.replace(QWEN35_MOE, name="qwen3-next", model_type="qwen3_next",
                                 maxtext_note=_NOTE.format("qwen3-next-80b-a3b"))

FAMILIES = (QWEN35, QWEN35_MOE, QWEN3_NEXT)
