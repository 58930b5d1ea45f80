"""Gemma 4 text (HF ``gemma4_text``; the multimodal releases' language model is read from them as Gemma 3's is):
sliding-window layers and global layers with heads of their own size (``per_layer_config``), per-head q/k RMSNorms
and a weightless v norm, sandwich norms, a scaled tied embedding, and in the small (E2B/E4B) models per-layer
inputs: a second embedding (``embed_tokens_per_layer``) projected into every layer through a gate. transformers'
files use the model's names (the tied head is not written).

MaxText 0.2.5 ships ``gemma4-e2b`` / ``-e4b`` / ``-26b`` / ``-31b``; deepspeed-ext does not map them yet.
"""

from deepspeed_ext.checkpoint.families import Family, partition_config
from deepspeed_ext.checkpoint.families.llama import ATTENTION_SPECS, QK_NORM_SPEC, mlp_specs

#: AutoTP for Gemma 4: DeepSpeed refuses transformers' plan (it lists "moe_tp_experts" entries even for the dense
#: models). Attention is split by heads (q/k norms whole, gradients summed over TP) and the MLP (column, then row).
#: The tied embedding and head, the per-layer-input embedding and its projections stay whole.
TENSOR_PARALLEL = partition_config(*ATTENTION_SPECS, *mlp_specs(r"mlp\."), QK_NORM_SPEC)

GEMMA4 = Family(name="gemma4",
                model_type="gemma4_text",
                rules=(),
                query_scaled=False,
                rope_interleaved=False,
                maxtext_model=None,
                maxtext_note="MaxText 0.2.5 has gemma4-e2b / -e4b / -26b / -31b; deepspeed-ext does not map them yet",
                tensor_parallel=TENSOR_PARALLEL)

FAMILIES = (GEMMA4, )
