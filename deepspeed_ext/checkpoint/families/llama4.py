"""Llama 4 text (HF ``llama4_text``, the language model of Scout and Maverick; MaxText decoder_block "llama4", model
llama4-17b-16e / -128e): GQA attention with weightless per-head q/k L2 norms and chunked attention in the RoPE layers,
RoPE and the norms left out of every ``no_rope_layer_interval``-th layer (global attention there, its query scaled by
position when ``attn_temperature_tuning``); the feed-forward is dense or a routed block (one shared expert,
``num_experts_per_tok`` routed experts held fused as ``experts.gate_up_proj`` [E, H, 2I] and ``experts.down_proj``
[E, I, H], a sigmoid router that scales the expert's input) as ``interleave_moe_layer_step`` says. transformers'
files use the model's names.

MaxText stacks, scanned, one layer per position in the cycle of NoPE and MoE layers (``layers/layers_<j>``, whole
cycles only); a MoE layer's block is ``Llama4MoEBlock_0`` (``MoeBlock_0``: router and experts [E, in, out];
``shared_experts``), a dense layer's ``mlp``. Both read RoPE pairs as adjacent elements (transformers by complex
multiplication), so q/k need no permutation; the query is scaled at run time.
"""

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from deepspeed_ext.checkpoint.families import Family, LayerBlock, Rule, cycle_blocks, partition_config
from deepspeed_ext.checkpoint.families.llama import (
    ATTENTION,
    ATTENTION_AND_HEAD_SPECS,
    EMBEDDING_AND_NORM,
    LM_HEAD,
    mlp_specs,
)
from deepspeed_ext.errors import CheckpointError

_F = "model.layers.{layer}.feed_forward"
_B = "decoder/{layers}/Llama4MoEBlock_0"
DENSE = (
    Rule(f"{_F}.gate_proj.weight", "decoder/{layers}/mlp/wi_0/kernel", "linear", block="dense"),
    Rule(f"{_F}.up_proj.weight", "decoder/{layers}/mlp/wi_1/kernel", "linear", block="dense"),
    Rule(f"{_F}.down_proj.weight", "decoder/{layers}/mlp/wo/kernel", "linear", block="dense"),
)
MOE = (
    Rule(f"{_F}.router.weight", f"{_B}/MoeBlock_0/gate/kernel", "linear", block="moe"),
    Rule(f"{_F}.experts.gate_up_proj", f"{_B}/MoeBlock_0/wi_0", "first_columns", block="moe"),
    Rule(f"{_F}.experts.gate_up_proj", f"{_B}/MoeBlock_0/wi_1", "last_columns", block="moe"),
    Rule(f"{_F}.experts.down_proj", f"{_B}/MoeBlock_0/wo", "copy", block="moe"),
    Rule(f"{_F}.shared_expert.gate_proj.weight", f"{_B}/shared_experts/wi_0/kernel", "linear", block="moe"),
    Rule(f"{_F}.shared_expert.up_proj.weight", f"{_B}/shared_experts/wi_1/kernel", "linear", block="moe"),
    Rule(f"{_F}.shared_expert.down_proj.weight", f"{_B}/shared_experts/wo/kernel", "linear", block="moe"),
)


def _is_moe(layer: int, config: Mapping[str, Any]) -> bool:
    step = int(config.get("interleave_moe_layer_step") or 1)
    return (layer + 1) % step == 0


def _cycle(config: Mapping[str, Any]) -> int:
    """MaxText's inhomogeneous_layer_cycle_interval: NoPE and MoE layers repeat every lcm of their intervals."""
    return math.lcm(int(config.get("no_rope_layer_interval") or 1), int(config.get("interleave_moe_layer_step") or 1))


def _blocks(config: Mapping[str, Any], scanned: bool) -> tuple[LayerBlock, ...]:
    """One stack per position in the cycle (scanned, whole cycles only) or ``layers_<i>``, each a MoE or a dense
    block as its layers are (every layer of a stack is the same kind: the cycle is a multiple of the MoE step)."""
    blocks = cycle_blocks(config, scanned, cycle=_cycle(config), remainder=None)
    return tuple(dataclasses.replace(block, kind="moe" if _is_moe(block.layers[0], config) else "dense")
                 for block in blocks)


def _maxtext_extra(c: Mapping[str, Any]) -> dict[str, Any]:
    layers = int(c["num_hidden_layers"])
    expected_moe = [i for i in range(layers) if _is_moe(i, c)]
    if c.get("moe_layers") is not None and list(c["moe_layers"]) != expected_moe:
        raise CheckpointError(f"llama4: moe_layers {c['moe_layers']} are not every interleave_moe_layer_step-th layer, "
                              "the only placement MaxText builds")
    interval = int(c.get("no_rope_layer_interval") or 0)
    expected_nope = [int(interval <= 0 or (i + 1) % interval != 0) for i in range(layers)]
    if c.get("no_rope_layers") is not None and list(c["no_rope_layers"]) != expected_nope:
        raise CheckpointError("llama4: no_rope_layers are not every no_rope_layer_interval-th layer, the only placement "
                              "MaxText builds")
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if rope.get("rope_type", "default") == "llama3":
        llama31 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}
        if any(float(rope.get(key, -1)) != value for key, value in llama31.items()):
            raise CheckpointError(f"llama4: MaxText's RoPE scaling is Llama 3.1's ({llama31}), not this config's "
                                  f"{ {key: rope.get(key) for key in llama31} }")
        use_scale = True
    elif rope.get("rope_type", "default") == "default":
        use_scale = False
    else:
        raise CheckpointError(f"llama4: RoPE type {rope.get('rope_type')!r} has no MaxText setting")
    if float(c.get("attn_scale", 0.1)) != 0.1 or float(c.get("floor_scale", 8192)) != 8192:
        raise CheckpointError("llama4: MaxText's attention temperature tuning is fixed at attn_scale 0.1 and "
                              "floor_scale 8192")
    return {"base_mlp_dim": c["intermediate_size_mlp"], "base_moe_mlp_dim": c["intermediate_size"],
            "num_experts": c["num_local_experts"], "num_experts_per_tok": c["num_experts_per_tok"],
            "shared_experts": 1, "nope_layer_interval": interval if interval > 0 else -1,
            "interleave_moe_layer_step": int(c.get("interleave_moe_layer_step") or 1),
            "inhomogeneous_layer_cycle_interval": _cycle(c), "use_qk_norm": bool(c.get("use_qk_norm", True)),
            "temperature_tuning": bool(c.get("attn_temperature_tuning", True)),
            "chunk_attn_window_size": c.get("attention_chunk_size") or 0, "rope_type": "llama3.1",
            "rope_use_scale": use_scale}


#: AutoTP for Llama 4: DeepSpeed refuses transformers' plan ("packed_rowwise", "moe_tp_experts"). Attention, the dense
#: feed-forwards and the shared experts are split (column, then row); the router and the fused experts stay whole.
TENSOR_PARALLEL = partition_config(*ATTENTION_AND_HEAD_SPECS, *mlp_specs(r"feed_forward\.(shared_expert\.)?"))

LLAMA4 = Family(name="llama4",
                model_type="llama4_text",
                rules=EMBEDDING_AND_NORM + ATTENTION + DENSE + MOE,
                untied_rules=LM_HEAD,
                query_scaled=False,
                rope_interleaved=False,
                maxtext_model="llama4-17b-16e",
                maxtext_extra=_maxtext_extra,
                layer_blocks=_blocks,
                tensor_parallel=TENSOR_PARALLEL,
                # The MoE block adds the routed experts into the shared expert's (row-split) output in place.
                inplace_outputs=(r"layers\.\d+\.feed_forward\.shared_expert\.down_proj", ))

FAMILIES = (LLAMA4, )
