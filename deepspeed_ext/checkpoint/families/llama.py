"""Llama-style decoders (MaxText decoder_block "llama2"/"mistral"): Llama 2/3, Llama 3.1, Mistral."""

from typing import Any

from deepspeed_ext.checkpoint.families import Family, Rule

_L = "model.layers.{layer}"
_M = "decoder/{layers}"

EMBEDDING_AND_NORM = (
    Rule("model.embed_tokens.weight", "token_embedder/embedding", "copy"),
    Rule("model.norm.weight", "decoder/decoder_norm/scale", "copy"),
)
LM_HEAD = (Rule("lm_head.weight", "decoder/logits_dense/kernel", "linear"), )
ATTENTION = (
    Rule(f"{_L}.input_layernorm.weight", f"{_M}/pre_self_attention_layer_norm/scale", "copy"),
    Rule(f"{_L}.self_attn.q_proj.weight", f"{_M}/self_attention/query/kernel", "query"),
    Rule(f"{_L}.self_attn.k_proj.weight", f"{_M}/self_attention/key/kernel", "key"),
    Rule(f"{_L}.self_attn.v_proj.weight", f"{_M}/self_attention/value/kernel", "value"),
    Rule(f"{_L}.self_attn.o_proj.weight", f"{_M}/self_attention/out/kernel", "out"),
    Rule(f"{_L}.post_attention_layernorm.weight", f"{_M}/post_self_attention_layer_norm/scale", "copy"),
)
DENSE_MLP = (
    Rule(f"{_L}.mlp.gate_proj.weight", f"{_M}/mlp/wi_0/kernel", "linear"),
    Rule(f"{_L}.mlp.up_proj.weight", f"{_M}/mlp/wi_1/kernel", "linear"),
    Rule(f"{_L}.mlp.down_proj.weight", f"{_M}/mlp/wo/kernel", "linear"),
)

#: AutoTP layer specs (DeepSpeed ``partition_config``) the families' presets are made of. Llama-style attention:
#: q/k/v split by output rows, o_proj by input columns; an untied head: lm_head by vocabulary, its output gathered.
#: MoE families whose tp_plan DeepSpeed refuses start from these.
ATTENTION_SPECS = (
    {"patterns": [r".*\.self_attn\.[qkv]_proj\.weight$"], "partition_type": "column"},
    {"patterns": [r".*\.self_attn\.o_proj\.weight$"], "partition_type": "row"},
)
HEAD_SPEC = {"patterns": [r"^lm_head\.weight$"], "partition_type": "column", "gather_output": True}
ATTENTION_AND_HEAD_SPECS = (*ATTENTION_SPECS, HEAD_SPEC)
#: Per-head q/k norms act on each rank's own heads: replicated, gradients summed over TP (without this the ranks'
#: copies drift apart, which the converter refuses to merge).
QK_NORM_SPEC = {"patterns": [r".*\.self_attn\.[qk]_norm\.weight$"], "partition_type": "skip", "grad_allreduce": True}


def mlp_specs(block: str) -> tuple[dict[str, Any], ...]:
    """A gated MLP split column (gate_proj, up_proj) then row (down_proj): the specs for the MLPs whose module path
    ends in ``block`` (a regular expression, e.g. ``r"mlp\.(shared_experts\.)?"`` for dense MLPs and shared experts)."""
    return ({"patterns": [rf".*\.{block}(gate|up)_proj\.weight$"], "partition_type": "column"},
            {"patterns": [rf".*\.{block}down_proj\.weight$"], "partition_type": "row"})

LLAMA = Family(name="llama",
               model_type="llama",
               rules=EMBEDDING_AND_NORM + ATTENTION + DENSE_MLP,
               untied_rules=LM_HEAD,
               query_scaled=True,
               rope_interleaved=False,
               maxtext_model="llama2-7b")

LLAMA31 = Family(name="llama3.1",
                 model_type="llama",
                 rope_type="llama3",
                 rules=LLAMA.rules,
                 untied_rules=LM_HEAD,
                 query_scaled=True,
                 rope_interleaved=True,
                 maxtext_model="llama3.1-8b")

MISTRAL = Family(name="mistral",
                 model_type="mistral",
                 rules=LLAMA.rules,
                 untied_rules=LM_HEAD,
                 query_scaled=True,
                 rope_interleaved=False,
                 maxtext_model="mistral-7b")

FAMILIES = (LLAMA, LLAMA31, MISTRAL)
