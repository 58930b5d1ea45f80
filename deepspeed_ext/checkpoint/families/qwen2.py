"""Qwen2 / Qwen2.5 (MaxText decoder_block "qwen2"): Llama attention with q/k/v biases, unscaled query.

transformers' Qwen2 always has the three biases (its config has no switch); MaxText needs
``attention_bias=true``, which its qwen2.5 configs set. The query is scaled at run time, not in the kernel.
"""

from deepspeed_ext.checkpoint.families import Family, Rule
from deepspeed_ext.checkpoint.families.llama import ATTENTION, DENSE_MLP, EMBEDDING_AND_NORM, LM_HEAD

_L = "model.layers.{layer}.self_attn"
_M = "decoder/{layers}/self_attention"
QKV_BIASES = (
    Rule(f"{_L}.q_proj.bias", f"{_M}/query/bias", "query_bias"),
    Rule(f"{_L}.k_proj.bias", f"{_M}/key/bias", "key_bias"),
    Rule(f"{_L}.v_proj.bias", f"{_M}/value/bias", "value_bias"),
)

QWEN2 = Family(name="qwen2",
               model_type="qwen2",
               rules=EMBEDDING_AND_NORM + ATTENTION + QKV_BIASES + DENSE_MLP,
               untied_rules=LM_HEAD,
               query_scaled=False,
               rope_interleaved=False,
               maxtext_model="qwen2.5-7b",
               maxtext_extra=lambda c: {"attention_bias": True})

FAMILIES = (QWEN2, )
