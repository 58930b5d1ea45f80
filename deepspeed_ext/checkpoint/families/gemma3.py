"""Gemma 3, the text model (MaxText decoder_block "gemma3"): q/k norms, four norms per layer (sandwich), a
GELU MLP, tied embeddings, five local (sliding-window) layers then one global.

MaxText stores what transformers computes on the fly: every RMSNorm scale as 1 + w (transformers keeps w and
adds 1 at run time) and the embedding multiplied by sqrt(hidden) (transformers scales the looked-up rows, in
the model's dtype; MaxText divides the tied logits by sqrt(hidden) again). Scanned, MaxText keeps one stack per
position in its six-layer cycle (``layers/layers_<j>`` = layers j, j+6, ...) and the layers after the last
whole cycle unstacked under ``layers_remainder``. The query is scaled at run time by 1/sqrt(query_pre_attn_scalar),
which MaxText derives from its model_name: gemma3-4b/12b use head_dim, gemma3-27b hidden/heads.
"""

from collections.abc import Mapping
from functools import partial
from typing import Any

from deepspeed_ext.checkpoint.families import Family, Rule, cycle_blocks
from deepspeed_ext.errors import CheckpointError

_L = "model.layers.{layer}"
_M = "decoder/{layers}"
RULES = (
    Rule("model.embed_tokens.weight", "token_embedder/embedding", "embed_scaled"),
    Rule("model.norm.weight", "decoder/decoder_norm/scale", "norm_plus_one"),
    Rule(f"{_L}.input_layernorm.weight", f"{_M}/pre_self_attention_norm/scale", "norm_plus_one"),
    Rule(f"{_L}.self_attn.q_proj.weight", f"{_M}/self_attention/query/kernel", "query"),
    Rule(f"{_L}.self_attn.k_proj.weight", f"{_M}/self_attention/key/kernel", "key"),
    Rule(f"{_L}.self_attn.v_proj.weight", f"{_M}/self_attention/value/kernel", "value"),
    Rule(f"{_L}.self_attn.o_proj.weight", f"{_M}/self_attention/out/kernel", "out"),
    Rule(f"{_L}.self_attn.q_norm.weight", f"{_M}/self_attention/query_norm/scale", "norm_plus_one"),
    Rule(f"{_L}.self_attn.k_norm.weight", f"{_M}/self_attention/key_norm/scale", "norm_plus_one"),
    Rule(f"{_L}.post_attention_layernorm.weight", f"{_M}/post_self_attention_norm/scale", "norm_plus_one"),
    Rule(f"{_L}.pre_feedforward_layernorm.weight", f"{_M}/pre_ffw_norm/scale", "norm_plus_one"),
    Rule(f"{_L}.post_feedforward_layernorm.weight", f"{_M}/post_ffw_norm/scale", "norm_plus_one"),
    Rule(f"{_L}.mlp.gate_proj.weight", f"{_M}/mlp/wi_0/kernel", "linear"),
    Rule(f"{_L}.mlp.up_proj.weight", f"{_M}/mlp/wi_1/kernel", "linear"),
    Rule(f"{_L}.mlp.down_proj.weight", f"{_M}/mlp/wo/kernel", "linear"),
)
LM_HEAD = (Rule("lm_head.weight", "decoder/logits_dense/kernel", "linear"), )


def _maxtext_extra(c: Mapping[str, Any]) -> dict[str, Any]:
    heads, hidden, head_dim = c["num_attention_heads"], c["hidden_size"], c.get("head_dim")
    scalar = c.get("query_pre_attn_scalar", head_dim)
    if scalar == head_dim:
        model_name = "gemma3-4b"
    elif scalar == hidden // heads:
        model_name = "gemma3-27b"
    else:
        raise CheckpointError(f"gemma3: query_pre_attn_scalar {scalar} is neither head_dim ({head_dim}) nor "
                              f"hidden/heads ({hidden // heads}), the two scales MaxText's gemma3 models use")
    rope = c.get("rope_parameters") or {}
    full, local = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    settings: dict[str, Any] = {
        "model_name": model_name, "use_multimodal": False, "normalize_embedding_logits": True,
        "sliding_window_size": c.get("sliding_window") or 0,
        "rope_linear_scaling_factor": float(full.get("factor", 1.0)) if full.get("rope_type") == "linear" else 1.0,
    }
    if local.get("rope_theta"):
        settings["local_rope_max_timescale"] = int(local["rope_theta"])
    if c.get("final_logit_softcapping"):
        settings["final_logits_soft_cap"] = c["final_logit_softcapping"]
    if c.get("attn_logit_softcapping"):
        settings["attn_logits_soft_cap"] = c["attn_logit_softcapping"]
    return settings


GEMMA3 = Family(name="gemma3",
                model_type="gemma3_text",
                rules=RULES,
                untied_rules=LM_HEAD,
                query_scaled=False,
                rope_interleaved=False,
                maxtext_model="gemma3-4b",
                maxtext_extra=_maxtext_extra,
                layer_blocks=partial(cycle_blocks, cycle=6, remainder="layers_remainder"))

FAMILIES = (GEMMA3, )
