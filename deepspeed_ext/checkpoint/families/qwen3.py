"""Qwen3 (MaxText decoder_block "qwen3"): q/k norms, unscaled query (scaled at run time), often tied."""

from deepspeed_ext.checkpoint.families import Family, Rule
from deepspeed_ext.checkpoint.families.llama import ATTENTION, DENSE_MLP, EMBEDDING_AND_NORM, LM_HEAD

QK_NORMS = (
    Rule("model.layers.{layer}.self_attn.q_norm.weight", "decoder/{layers}/self_attention/query_norm/scale", "copy"),
    Rule("model.layers.{layer}.self_attn.k_norm.weight", "decoder/{layers}/self_attention/key_norm/scale", "copy"),
)

QWEN3 = Family(name="qwen3",
               model_type="qwen3",
               rules=EMBEDDING_AND_NORM + ATTENTION + QK_NORMS + DENSE_MLP,
               untied_rules=LM_HEAD,
               query_scaled=False,
               rope_interleaved=False,
               maxtext_model="qwen3-0.6b")

FAMILIES = (QWEN3, )
