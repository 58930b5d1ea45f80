"""GLM-4.5 / GLM-4.6 / GLM-4.7 (HF ``glm4_moe``): GQA attention with q/k/v biases, partial rotary and optional
per-head q/k norms; the first ``first_k_dense_replace`` layers dense, the rest routed experts with shared experts
and a router bias (``e_score_correction_bias``, a buffer); a multi-token-prediction layer past
``num_hidden_layers`` in the releases (``--mtp``). transformers holds the experts fused ([E, 2I, H], [E, H, I]);
its files write them one by one, as for Qwen3-MoE.

MaxText 0.2.5 has no GLM model: to-maxtext refuses the family.
"""

from deepspeed_ext.checkpoint.families import Family, partition_config
from deepspeed_ext.checkpoint.families.llama import ATTENTION_AND_HEAD_SPECS, QK_NORM_SPEC, mlp_specs
from deepspeed_ext.checkpoint.families.qwen3_moe import HF_EXPERTS

#: AutoTP for GLM-4.5: DeepSpeed refuses transformers' plan ("packed_colwise", "moe_tp_experts"). Attention (with its
#: biases), the dense MLPs and the shared experts are split; the per-head q/k norms stay whole with their gradients
#: summed over TP. The router and the fused experts stay whole.
TENSOR_PARALLEL = partition_config(*ATTENTION_AND_HEAD_SPECS, *mlp_specs(r"mlp\.(shared_experts\.)?"), QK_NORM_SPEC)

GLM45 = Family(name="glm-4.5",
               model_type="glm4_moe",
               rules=(),
               query_scaled=False,
               rope_interleaved=False,
               maxtext_model=None,
               maxtext_note="MaxText 0.2.5 has no GLM model",
               hf_expert_splits=HF_EXPERTS,
               tensor_parallel=TENSOR_PARALLEL,
               # AutoEP: DeepSeek-V3's preset fits GLM-4.5's MoE block (sigmoid routing with the router bias, groups,
               # shared experts).
               expert_parallel="deepseek_v3")

FAMILIES = (GLM45, )
