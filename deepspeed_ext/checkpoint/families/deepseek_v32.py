"""DeepSeek-V3.2 (HF ``deepseek_v32``) and GLM-5 (HF ``glm_moe_dsa``): DeepSeek-V3's multi-head latent attention
and mixture of experts, plus the sparse-attention indexer (``self_attn.indexer``: ``wq_b``, ``wk``, ``k_norm`` with
a bias, ``weights_proj``), which picks the keys each query attends to. Releases carry a multi-token-prediction layer
past ``num_hidden_layers`` (``--mtp``). transformers holds the experts fused; its files write them one by one.

MaxText 0.2.5 ships ``deepseek3.2-671b``; deepspeed-ext does not map it yet. It has no GLM model.
"""

from deepspeed_ext.checkpoint.families import Family
from deepspeed_ext.checkpoint.families.qwen3_moe import HF_EXPERTS

#: AutoTP for MLA with an indexer: as DeepSeek-V3's preset (its rotary key, shared by every head, keeps attention
#: whole), the indexer whole with it; the dense MLPs and the shared experts are split, and lm_head by vocabulary.
TENSOR_PARALLEL = {"partition_config": {
    "use_default_specs": False,
    "layer_specs": [
        {"patterns": [r".*\.mlp\.(shared_experts\.)?(gate|up)_proj\.weight$"], "partition_type": "column"},
        {"patterns": [r".*\.mlp\.(shared_experts\.)?down_proj\.weight$"], "partition_type": "row"},
        {"patterns": [r"^lm_head\.weight$"], "partition_type": "column", "gather_output": True},
    ],
}}

#: AutoEP: DeepSeek-V3's preset fits the MoE block as it is (grouped sigmoid routing with the router bias, shared
#: experts).
EXPERT_PARALLEL = "deepseek_v3"

DEEPSEEK_V32 = Family(name="deepseek-v3.2",
                      model_type="deepseek_v32",
                      rules=(),
                      query_scaled=False,
                      rope_interleaved=False,
                      maxtext_model=None,
                      maxtext_note="MaxText 0.2.5 has deepseek3.2-671b; deepspeed-ext does not map it yet",
                      hf_expert_splits=HF_EXPERTS,
                      tensor_parallel=TENSOR_PARALLEL,
                      expert_parallel=EXPERT_PARALLEL)

GLM5 = Family(name="glm-5",
              model_type="glm_moe_dsa",
              rules=(),
              query_scaled=False,
              rope_interleaved=False,
              maxtext_model=None,
              maxtext_note="MaxText 0.2.5 has no GLM model",
              hf_expert_splits=HF_EXPERTS,
              tensor_parallel=TENSOR_PARALLEL,
              expert_parallel=EXPERT_PARALLEL)

FAMILIES = (DEEPSEEK_V32, GLM5)
