"""Qwen3-MoE (MaxText decoder_block "qwen3_moe"): Qwen3 attention + a routed expert block per layer.

transformers 5.x stores a layer's experts fused: ``experts.gate_up_proj`` [E, 2I, H] (gate rows first)
and ``experts.down_proj`` [E, H, I]; MaxText keeps ``moe_block/wi_0``, ``wi_1`` [E, H, I] and ``wo`` [E, I, H]
(stacked as [E, L, ...] when scanned).
"""

from deepspeed_ext.checkpoint.families import ExpertSplit, Family, Rule, num_experts, partition_config
from deepspeed_ext.checkpoint.families.llama import (
    ATTENTION,
    ATTENTION_AND_HEAD_SPECS,
    EMBEDDING_AND_NORM,
    LM_HEAD,
    QK_NORM_SPEC,
)
from deepspeed_ext.checkpoint.families.qwen3 import QK_NORMS

_L = "model.layers.{layer}.mlp"
_M = "decoder/{layers}/moe_block"
MOE_BLOCK = (
    Rule(f"{_L}.gate.weight", f"{_M}/gate/kernel", "linear"),
    Rule(f"{_L}.experts.gate_up_proj", f"{_M}/wi_0", "expert_gate"),
    Rule(f"{_L}.experts.gate_up_proj", f"{_M}/wi_1", "expert_up"),
    Rule(f"{_L}.experts.down_proj", f"{_M}/wo", "expert_down"),
)

#: transformers' save_pretrained writes the experts one by one (``experts.<e>.gate_proj.weight`` [I, H], ...).
HF_EXPERTS = (
    ExpertSplit(f"{_L}.experts.gate_up_proj",
                (f"{_L}.experts.{{expert}}.gate_proj.weight", f"{_L}.experts.{{expert}}.up_proj.weight")),
    ExpertSplit(f"{_L}.experts.down_proj", (f"{_L}.experts.{{expert}}.down_proj.weight", )),
)

#: AutoTP for Qwen3-MoE: DeepSpeed refuses transformers' own tp_plan for it (its "moe_tp_experts" and
#: "packed_colwise" styles), so the Linear layers are named. The fused 3-D experts are not nn.Linear weights
#: and stay whole on every TP rank, as does the router.
TENSOR_PARALLEL = partition_config(*ATTENTION_AND_HEAD_SPECS, QK_NORM_SPEC)

QWEN3_MOE = Family(name="qwen3-moe",
                   model_type="qwen3_moe",
                   rules=EMBEDDING_AND_NORM + ATTENTION + QK_NORMS + MOE_BLOCK,
                   untied_rules=LM_HEAD,
                   query_scaled=False,
                   rope_interleaved=False,
                   maxtext_model="qwen3-30b-a3b",
                   maxtext_extra=lambda c: {"num_experts": num_experts(c),
                                            "num_experts_per_tok": c["num_experts_per_tok"],
                                            "base_moe_mlp_dim": c["moe_intermediate_size"],
                                            "norm_topk_prob": bool(c.get("norm_topk_prob", True))},
                   hf_expert_splits=HF_EXPERTS,
                   tensor_parallel=TENSOR_PARALLEL,
                   expert_parallel="qwen3_moe")


FAMILIES = (QWEN3_MOE, )
