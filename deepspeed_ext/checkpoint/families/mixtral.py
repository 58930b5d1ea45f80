"""Mixtral (MaxText decoder_block "mixtral"): Llama attention (query kernel pre-scaled by 1/sqrt(head_dim),
as for Llama) and a routed expert block per layer, ``MoeBlock_0``.

transformers 5.x holds a layer's experts fused, ``mlp.experts.gate_up_proj`` [E, 2I, H] (w1 rows, then w3
rows) and ``mlp.experts.down_proj`` [E, H, I] (w2), with the router at ``mlp.gate``; its files keep the
original names, ``block_sparse_moe.experts.<e>.w1|w3|w2.weight`` and ``block_sparse_moe.gate.weight``.
MaxText stacks the experts as ``wi_0``/``wi_1`` [E, H, I] and ``wo`` [E, I, H] ([E, L, ...] scanned).
"""

from deepspeed_ext.checkpoint.families import ExpertSplit, Family, Rule, num_experts, partition_config
from deepspeed_ext.checkpoint.families.llama import ATTENTION, ATTENTION_AND_HEAD_SPECS, EMBEDDING_AND_NORM, LM_HEAD

_L = "model.layers.{layer}.mlp"
_F = "model.layers.{layer}.block_sparse_moe"
_M = "decoder/{layers}/MoeBlock_0"
MOE_BLOCK = (
    Rule(f"{_L}.gate.weight", f"{_M}/gate/kernel", "linear"),
    Rule(f"{_L}.experts.gate_up_proj", f"{_M}/wi_0", "expert_gate"),
    Rule(f"{_L}.experts.gate_up_proj", f"{_M}/wi_1", "expert_up"),
    Rule(f"{_L}.experts.down_proj", f"{_M}/wo", "expert_down"),
)

HF_FILES = (
    ExpertSplit(f"{_L}.gate.weight", (f"{_F}.gate.weight", )),
    ExpertSplit(f"{_L}.experts.gate_up_proj",
                (f"{_F}.experts.{{expert}}.w1.weight", f"{_F}.experts.{{expert}}.w3.weight")),
    ExpertSplit(f"{_L}.experts.down_proj", (f"{_F}.experts.{{expert}}.w2.weight", )),
)

#: AutoTP for Mixtral under transformers 5: DeepSpeed refuses the model's own tp_plan (its "packed_colwise"
#: and "moe_tp_experts" styles), so the Linear layers are named. The fused 3-D experts are not nn.Linear
#: weights and stay whole on every TP rank, as does the router.
TENSOR_PARALLEL = partition_config(*ATTENTION_AND_HEAD_SPECS)

MIXTRAL = Family(name="mixtral",
                 model_type="mixtral",
                 rules=EMBEDDING_AND_NORM + ATTENTION + MOE_BLOCK,
                 untied_rules=LM_HEAD,
                 query_scaled=True,
                 rope_interleaved=False,
                 maxtext_model="mixtral-8x7b",
                 maxtext_extra=lambda c: {"num_experts": num_experts(c),
                                          "num_experts_per_tok": c["num_experts_per_tok"],
                                          "base_moe_mlp_dim": c["intermediate_size"]},
                 hf_expert_splits=HF_FILES,
                 tensor_parallel=TENSOR_PARALLEL,
                 expert_parallel="mixtral")

FAMILIES = (MIXTRAL, )
