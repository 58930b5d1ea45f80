"""DeepSeek-V3.2 (HF ``deepseek_v32``) and GLM-5 (HF ``glm_moe_dsa``): DeepSeek-V3's multi-head latent attention
and mixture of experts, plus the sparse-attention indexer (``self_attn.indexer``: ``wq_b``, ``wk``, ``k_norm`` with
a bias, ``weights_proj``), which picks the keys each query attends to. Releases carry a multi-token-prediction layer
past ``num_hidden_layers`` (``--mtp``). transformers holds the experts fused; its files write them one by one.

DeepSeek-V3.2 goes to MaxText's ``deepseek3.2-671b`` (its deepseek decoder with ``use_indexer``): DeepSeek-V3's
rules plus the indexer's, under ``self_attention/indexer`` (``wq_b`` split by the indexer's own heads, ``wk`` and
``weights_proj`` plain kernels, ``k_norm`` a LayerNorm's scale and bias). MaxText has no GLM model.
"""

from collections.abc import Mapping
from typing import Any

from deepspeed_ext.checkpoint.families import Family, Rule
from deepspeed_ext.checkpoint.families.deepseek_v3 import DEEPSEEK_V3
from deepspeed_ext.checkpoint.families.qwen3_moe import HF_EXPERTS

_I = "model.layers.{layer}.self_attn.indexer"
_M = "decoder/{layers}/self_attention/indexer"
INDEXER = (
    Rule(f"{_I}.wq_b.weight", f"{_M}/wq_b/kernel", "indexer_head_rows"),
    Rule(f"{_I}.wk.weight", f"{_M}/wk/kernel", "linear"),
    Rule(f"{_I}.k_norm.weight", f"{_M}/k_norm/scale", "copy"),
    Rule(f"{_I}.k_norm.bias", f"{_M}/k_norm/bias", "copy"),
    Rule(f"{_I}.weights_proj.weight", f"{_M}/weights_proj/kernel", "linear"),
)


def _maxtext_extra(c: Mapping[str, Any]) -> dict[str, Any]:
    mla = DEEPSEEK_V3.maxtext_extra(c) if DEEPSEEK_V3.maxtext_extra else {}
    return {**mla, "use_indexer": True, "indexer_n_heads": c["index_n_heads"],
            "indexer_head_dim": c["index_head_dim"], "indexer_topk": c["index_topk"]}

#: AutoTP for MLA with an indexer: DeepSeek-V3's preset (its rotary key, shared by every head, keeps attention
#: whole), the indexer whole with it; the dense MLPs and the shared experts are split, and lm_head by vocabulary.
TENSOR_PARALLEL = DEEPSEEK_V3.tensor_parallel

#: AutoEP: DeepSeek-V3's preset fits the MoE block as it is (grouped sigmoid routing with the router bias, shared
#: experts).
EXPERT_PARALLEL = "deepseek_v3"

DEEPSEEK_V32 = Family(name="deepseek-v3.2",
                      model_type="deepseek_v32",
                      rules=DEEPSEEK_V3.rules + INDEXER,
                      untied_rules=DEEPSEEK_V3.untied_rules,
                      query_scaled=False,
                      rope_interleaved=False,
                      maxtext_model="deepseek3.2-671b",
                      maxtext_extra=_maxtext_extra,
                      layer_blocks=DEEPSEEK_V3.layer_blocks,
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
