"""OLMo 3 (HF ``olmo3``; MaxText decoder_block "olmo3", model olmo3-7b / olmo3-32b): Llama-like attention whose q/k
RMSNorms normalize the whole projection (all heads at once; MaxText's GlobalRMSNorm), norms after attention and after
the MLP only (no norm before them), and three sliding-window layers then a global one, repeating.

MaxText fixes the layer pattern (three sliding, one global) and, scanned, stacks one layer per position in that
cycle of four (``layers/layers_<j>`` = layers j, j+4, ...), taking whole cycles only. Its attention module is
``attention`` (not ``self_attention``); the query is scaled at run time.
"""

from collections.abc import Mapping
from functools import partial
from typing import Any

from deepspeed_ext.checkpoint.families import Family, Rule, cycle_blocks, partition_config
from deepspeed_ext.checkpoint.families.llama import DENSE_MLP, EMBEDDING_AND_NORM, HEAD_SPEC, LM_HEAD, mlp_specs
from deepspeed_ext.errors import CheckpointError

_L = "model.layers.{layer}"
_A = "decoder/{layers}/attention"
RULES = EMBEDDING_AND_NORM + (
    Rule(f"{_L}.self_attn.q_proj.weight", f"{_A}/query/kernel", "query"),
    Rule(f"{_L}.self_attn.k_proj.weight", f"{_A}/key/kernel", "key"),
    Rule(f"{_L}.self_attn.v_proj.weight", f"{_A}/value/kernel", "value"),
    Rule(f"{_L}.self_attn.o_proj.weight", f"{_A}/out/kernel", "out"),
    Rule(f"{_L}.self_attn.q_norm.weight", f"{_A}/query_norm/scale", "copy"),
    Rule(f"{_L}.self_attn.k_norm.weight", f"{_A}/key_norm/scale", "copy"),
    Rule(f"{_L}.post_attention_layernorm.weight", "decoder/{layers}/post_self_attention_layer_norm/scale", "copy"),
    Rule(f"{_L}.post_feedforward_layernorm.weight", "decoder/{layers}/post_mlp_layer_norm/scale", "copy"),
) + DENSE_MLP

#: MaxText's fixed layer pattern (its olmo3.py): three sliding-window layers, then one global.
CYCLE = ("sliding_attention", "sliding_attention", "sliding_attention", "full_attention")


def _maxtext_extra(c: Mapping[str, Any]) -> dict[str, Any]:
    layers = int(c["num_hidden_layers"])
    types = list(c.get("layer_types") or [])
    expected = [CYCLE[i % len(CYCLE)] for i in range(layers)]
    if types and types != expected:
        raise CheckpointError(f"olmo3: layer_types {types} are not MaxText's fixed pattern of three sliding-window "
                              "layers then a global one")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if isinstance(rope.get("full_attention"), Mapping):  # per layer type: transformers applies one RoPE to all
        rope = rope["full_attention"]
    settings: dict[str, Any] = {"sliding_window_size": c.get("sliding_window") or 0, "use_qk_norm": True,
                                "attention_bias": bool(c.get("attention_bias", False))}
    if rope.get("rope_type", "default") == "yarn":
        settings.update(rope_type="yarn", rope_factor=rope.get("factor", 1.0),
                        original_max_position_embeddings=rope.get("original_max_position_embeddings"),
                        beta_fast=rope.get("beta_fast", 32.0), beta_slow=rope.get("beta_slow", 1.0),
                        rope_attention_scaling=True, rope_truncate=bool(rope.get("truncate", True)),
                        max_position_embeddings=c.get("max_position_embeddings"))
    elif rope.get("rope_type", "default") == "default":
        settings["rope_type"] = "default"
    else:
        raise CheckpointError(f"olmo3: RoPE type {rope.get('rope_type')!r} has no MaxText setting (default and yarn "
                              "have)")
    return settings


#: AutoTP for OLMo 3: DeepSpeed refuses transformers' plan ("colwise_gather_output" / "rowwise_split_input" around the
#: q/k norms). Those norms normalize the whole q (k) projection, so a rank holding some heads cannot compute them:
#: attention stays whole. The MLP is split (column, then row) and lm_head by vocabulary.
TENSOR_PARALLEL = partition_config(*mlp_specs(r"mlp\."), HEAD_SPEC)

OLMO3 = Family(name="olmo3",
               model_type="olmo3",
               rules=RULES,
               untied_rules=LM_HEAD,
               query_scaled=False,
               rope_interleaved=False,
               maxtext_model="olmo3-7b",
               maxtext_extra=_maxtext_extra,
               layer_blocks=partial(cycle_blocks, cycle=len(CYCLE), remainder=None),
               tensor_parallel=TENSOR_PARALLEL)

FAMILIES = (OLMO3, )
