"""Gemma 4 text (HF ``gemma4_text``; the multimodal releases' language model is read from them as Gemma 3's is):
sliding-window layers and global layers with heads of their own size (``per_layer_config``, or the released configs'
``global_head_dim`` / ``num_global_key_value_heads``), per-head q/k RMSNorms and a weightless v norm, sandwich norms,
a scaled tied embedding, a ``layer_scalar`` per layer (a buffer), final logit softcapping and an unscaled query (the
q/k norms stand in for 1/sqrt(d)). The small models (E2B/E4B) add per-layer inputs: a second embedding
(``embed_tokens_per_layer``) and a projection of the first, fed into every layer through a gate; and their last
``num_kv_shared_layers`` layers reuse the K/V of the last earlier layer of their kind (no k/v projections or k norm
of their own), E2B's with an MLP twice as wide. The 26B model (``enable_moe_block``) adds to every layer's MLP, which
becomes its shared expert, a routed block (router with an input scale and a per-expert scale, fused experts
``gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I], three more norms). transformers' files use the model's names
(the tied head is not written).

MaxText 0.2.5 holds these in two decoders, which deepspeed-ext picks from the config. ``gemma4`` (model gemma4-31b;
with the MoE block gemma4-26b): five sliding-window layers then a global one, whole cycles; scanned, MaxText nests a
scan in a scan: ``scanned_blocks/local_layers`` stacks the sliding layers on two axes (cycles, 5) and
``scanned_blocks/global_layer`` the global ones; the MoE block is ``mlp/moe_block`` (``MoeBlock_0``, whose
``per_expert_scale`` is the router's, and ``shared_experts``) with the router's input scale at
``mlp/pre_forward_scale_2``. ``gemma4_small`` (gemma4-e2b: four sliding layers then a global one; gemma4-e4b: five
then one), for per-layer inputs and KV-shared layers: unscanned only (MaxText builds no scanned form), with no MoE
block and no shared k/v projection (``attention_k_eq_v``). MaxText stores the RMSNorm scales as they are (Gemma 4's
norms multiply by w, not 1 + w), the embedding pre-multiplied by sqrt(hidden) as for gemma3 (tied logits normalized
back), and the per-layer-input embedding as it is (both sides scale it by sqrt(its width) at run time);
``layer_scalar`` is a MaxText parameter, which MaxText trains.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from deepspeed_ext.checkpoint.families import Family, LayerBlock, Rule, partition_config
from deepspeed_ext.checkpoint.families.llama import ATTENTION_SPECS, LM_HEAD, QK_NORM_SPEC, mlp_specs
from deepspeed_ext.errors import CheckpointError

_L = "model.layers.{layer}"
_M = "decoder/{layers}"
SLIDING, FULL = "sliding_attention", "full_attention"
#: The MaxText model whose attention pattern is four sliding-window layers then a global one (its others: five then
#: one).
CYCLE_OF_FIVE = "gemma4-e2b"


def layer_types(c: Mapping[str, Any]) -> list[str]:
    """The config's layer types (transformers' default: every sixth layer global, and the last)."""
    layers = int(c["num_hidden_layers"])
    types = list(c.get("layer_types") or [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(layers)])
    types[-1] = FULL  # transformers makes the last layer global whatever the config says
    return types


def global_attention(c: Mapping[str, Any]) -> tuple[int, int]:
    """(head size, KV heads) of the global layers: ``per_layer_config``'s overrides (what transformers writes), else
    the released configs' ``global_head_dim`` (transformers' default 512) and ``num_global_key_value_heads`` (which
    transformers applies with ``attention_k_eq_v``)."""
    head_dim, kv_heads = int(c["head_dim"]), int(c.get("num_key_value_heads") or c["num_attention_heads"])
    overrides = c.get("per_layer_config")
    if overrides is None:
        global_kv = c.get("num_global_key_value_heads") if c.get("attention_k_eq_v", True) else None
        return int(c.get("global_head_dim") or 512), int(global_kv or kv_heads)
    by_layer = {int(layer): dict(values) for layer, values in overrides.items()}
    types = layer_types(c)
    unknown = sorted({key for values in by_layer.values() for key in values} - {"head_dim", "num_key_value_heads"})
    sliding = sorted(layer for layer in by_layer if layer >= len(types) or types[layer] != FULL)
    sizes = {(int(by_layer.get(layer, {}).get("head_dim", head_dim)),
              int(by_layer.get(layer, {}).get("num_key_value_heads", kv_heads)))
             for layer, kind in enumerate(types) if kind == FULL}
    if unknown or sliding or len(sizes) != 1:
        raise CheckpointError(f"gemma4: per_layer_config {dict(overrides)} is not what MaxText builds: one head size "
                              "and KV head count for every global layer (and nothing else per layer)")
    (size, ) = sizes
    return size


@dataclass(frozen=True)
class Layout:
    """What MaxText builds for a Gemma 4 config: its model (and so its decoder), and per layer what it holds."""

    model: str  # MaxText's model_name
    kinds: tuple[str, ...]  # per layer: "sliding" / "full", with "_shared" where it reuses an earlier layer's K/V
    per_layer_inputs: bool
    moe: bool
    k_eq_v: bool  # the global layers' values are their keys (no v_proj)
    double_wide: bool  # the KV-shared layers' MLPs are twice as wide

    @property
    def small(self) -> bool:
        """MaxText's gemma4_small decoder (unscanned only)."""
        return self.model in (CYCLE_OF_FIVE, "gemma4-e4b")


def _pattern(period: int, layers: int) -> list[str]:
    return [FULL if (i + 1) % period == 0 else SLIDING for i in range(layers)]


def layout(c: Mapping[str, Any]) -> Layout:
    """The MaxText form of config ``c``, or a one-line refusal saying what MaxText cannot build."""
    types, layers = layer_types(c), int(c["num_hidden_layers"])
    periods = [period for period in (6, 5) if types == _pattern(period, layers)]
    if not periods:
        globals_at = [i for i, kind in enumerate(types) if kind == FULL]
        raise CheckpointError(f"gemma4: layer_types (of {layers} layers, global at {globals_at}) are not a pattern "
                              "MaxText builds: whole cycles of five sliding-window layers then a global one "
                              f"(gemma4-31b / -26b / -e4b), or of four then one ({CYCLE_OF_FIVE})")
    per_layer_inputs = int(c.get("hidden_size_per_layer_input") or 0) > 0
    moe, k_eq_v = bool(c.get("enable_moe_block")), bool(c.get("attention_k_eq_v"))
    kv_shared = int(c.get("num_kv_shared_layers") or 0)
    first_shared = layers - kv_shared
    small = per_layer_inputs or kv_shared > 0 or periods[0] == 5
    if small and (moe or k_eq_v):
        raise CheckpointError(f"gemma4: MaxText builds per-layer inputs, KV-shared layers and the cycle of five only "
                              f"in its gemma4_small decoder, which has no {'MoE block' if moe else 'attention_k_eq_v'}")
    donors = set(types[:max(first_shared, 0)])
    if kv_shared and (first_shared <= 0 or not set(types[first_shared:]) <= donors):
        raise CheckpointError(f"gemma4: num_kv_shared_layers {kv_shared} of {layers} leaves a KV-shared layer "
                              "without an earlier layer of its kind to take K/V from")
    kinds = tuple(("full" if kind == FULL else "sliding") + ("_shared" if kv_shared and i >= first_shared else "")
                  for i, kind in enumerate(types))
    model = (CYCLE_OF_FIVE if periods[0] == 5 else "gemma4-e4b") if small else "gemma4-26b" if moe else "gemma4-31b"
    return Layout(model, kinds, per_layer_inputs, moe, k_eq_v,
                  double_wide=bool(c.get("use_double_wide_mlp")) and kv_shared > 0)


def _blocks(c: Mapping[str, Any], scanned: bool) -> tuple[LayerBlock, ...]:
    """Unscanned ``layers_<i>``; scanned (the gemma4 decoder), one stack of the sliding layers on two axes (cycles,
    five) and one of the global layers."""
    found = layout(c)
    if not scanned:
        return tuple(LayerBlock(f"layers_{i}", (i, ), False, kind=kind) for i, kind in enumerate(found.kinds))
    if found.small:
        raise CheckpointError(f"gemma4: MaxText's gemma4_small decoder ({found.model}: per-layer inputs, KV-shared "
                              "layers or the cycle of five) does not scan its layers; write it with --no-scan-layers")
    starts = range(0, len(found.kinds), 6)
    return (LayerBlock("scanned_blocks/local_layers", tuple(s + j for s in starts for j in range(5)), True,
                       kind="sliding", stack=(len(starts), 5)),
            LayerBlock("scanned_blocks/global_layer", tuple(s + 5 for s in starts), True, kind="full"))


_A = f"{_M}/self_attention"
_MOE = f"{_M}/mlp/moe_block"


def _layer_rules(kind: str, found: Layout) -> list[Rule]:
    """The rules of one kind of layer (its attention, its K/V, its MLP)."""
    wide, shared = kind.startswith("full"), kind.endswith("_shared")
    heads = "global_heads" if wide else None
    specs = [
        ("input_layernorm.weight", f"{_M}/pre_self_attention_norm/scale", "copy"),
        ("post_attention_layernorm.weight", f"{_M}/post_self_attention_norm/scale", "copy"),
        ("pre_feedforward_layernorm.weight", f"{_M}/pre_ffw_norm/scale", "copy"),
        ("post_feedforward_layernorm.weight", f"{_M}/post_ffw_norm/scale", "copy"),
        ("layer_scalar", f"{_M}/layer_scalar", "copy"),
        ("self_attn.q_proj.weight", f"{_A}/query/kernel", heads or "query"),
        ("self_attn.q_norm.weight", f"{_A}/query_norm/scale", "copy"),
        ("self_attn.o_proj.weight", f"{_A}/out/kernel", "global_out" if wide else "out"),
    ]
    if not shared:
        specs += [("self_attn.k_proj.weight", f"{_A}/key/kernel", heads or "key"),
                  ("self_attn.k_norm.weight", f"{_A}/key_norm/scale", "copy")]
        if not (wide and found.k_eq_v):
            specs.append(("self_attn.v_proj.weight", f"{_A}/value/kernel", heads or "value"))
    mlp = f"{_MOE}/shared_experts" if found.moe else f"{_M}/mlp"
    specs += [("mlp.gate_proj.weight", f"{mlp}/wi_0/kernel", "linear"),
              ("mlp.up_proj.weight", f"{mlp}/wi_1/kernel", "linear"),
              ("mlp.down_proj.weight", f"{mlp}/wo/kernel", "linear")]
    if found.moe:
        specs += [("router.proj.weight", f"{_MOE}/MoeBlock_0/gate/kernel", "linear"),
                  ("router.scale", f"{_M}/mlp/pre_forward_scale_2", "copy"),
                  ("router.per_expert_scale", f"{_MOE}/MoeBlock_0/per_expert_scale", "copy"),
                  ("experts.gate_up_proj", f"{_MOE}/MoeBlock_0/wi_0", "expert_gate"),
                  ("experts.gate_up_proj", f"{_MOE}/MoeBlock_0/wi_1", "expert_up"),
                  ("experts.down_proj", f"{_MOE}/MoeBlock_0/wo", "expert_down")]
        specs += [(f"{norm}.weight", f"{_M}/mlp/{norm}/scale", "copy") for norm in
                  ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2")]
    if found.per_layer_inputs:
        specs += [("per_layer_input_gate.weight", f"{_M}/per_layer_input_gate/kernel", "linear"),
                  ("per_layer_projection.weight", f"{_M}/per_layer_projection/kernel", "linear"),
                  ("post_per_layer_input_norm.weight", f"{_M}/post_per_layer_input_norm/scale", "copy")]
    return [Rule(f"{_L}.{hf}", path, transform, block=kind) for hf, path, transform in specs]


_E = "decoder/per_layer_embedder"
EMBEDDING_AND_NORM = (Rule("model.embed_tokens.weight", "token_embedder/embedding", "embed_scaled"),
                      Rule("model.norm.weight", "decoder/decoder_norm/scale", "copy"))
PER_LAYER_INPUTS = (
    Rule("model.embed_tokens_per_layer.weight", f"{_E}/embed_tokens_per_layer", "copy"),
    Rule("model.per_layer_model_projection.weight", f"{_E}/per_layer_model_projection/kernel", "linear"),
    Rule("model.per_layer_projection_norm.weight", f"{_E}/per_layer_projection_norm/scale", "copy"),
)


def _rules(c: Mapping[str, Any]) -> tuple[Rule, ...]:
    """The model's rules: every kind of layer it has (each kind's own, as its shapes differ), and the per-layer
    inputs' embedding and projection where it has them."""
    found = layout(c)
    layers = [rule for kind in dict.fromkeys(found.kinds) for rule in _layer_rules(kind, found)]
    return EMBEDDING_AND_NORM + (PER_LAYER_INPUTS if found.per_layer_inputs else ()) + tuple(layers)


#: transformers' RoPE for a config without ``rope_parameters``.
DEFAULT_ROPE: dict[str, dict[str, Any]] = {SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                                         FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                "rope_theta": 1000000.0}}


def _rope(c: Mapping[str, Any], kind: str) -> tuple[int, float]:
    """(theta, rotated fraction) of a layer kind's RoPE: default, or proportional (a fraction of the head rotated,
    its frequencies over the whole head), the two MaxText's Gemma 4 rotary embeddings compute (its thetas are
    integers)."""
    rope = (c.get("rope_parameters") or DEFAULT_ROPE).get(kind) or {}
    rope_type, theta = rope.get("rope_type", "default"), float(rope.get("rope_theta", 10000.0))
    if theta.is_integer() and rope_type == "default":
        return int(theta), 1.0
    if theta.is_integer() and rope_type == "proportional" and float(rope.get("factor", 1.0)) == 1.0:
        return int(theta), float(rope.get("partial_rotary_factor", 1.0))
    raise CheckpointError(f"gemma4: {kind} RoPE {dict(rope)} has no MaxText setting (default and proportional RoPE "
                          "without scaling, of an integer theta, have)")


def _maxtext_extra(c: Mapping[str, Any]) -> dict[str, Any]:
    found = layout(c)
    if float(c.get("rms_norm_eps", 1e-6)) != 1e-6:
        raise CheckpointError(f"gemma4: rms_norm_eps {c.get('rms_norm_eps')}: MaxText's Gemma 4 layers fix their "
                              "norms' epsilon at 1e-6")
    if c.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise CheckpointError(f"gemma4: hidden_activation {c.get('hidden_activation')!r}: MaxText's Gemma 4 gates "
                              "use tanh-approximated GELU")
    if c.get("use_bidirectional_attention") == "all":
        raise CheckpointError("gemma4: use_bidirectional_attention 'all': MaxText's Gemma 4 text attention is causal")
    softcap = c.get("final_logit_softcapping")
    if softcap and not c.get("tie_word_embeddings", True):
        raise CheckpointError("gemma4: MaxText caps the logits (final_logit_softcapping) only when the head is tied "
                              "to the embedding")
    (local_theta, local_fraction), (global_theta, global_fraction) = _rope(c, SLIDING), _rope(c, FULL)
    head_dim, kv_heads = global_attention(c)
    settings: dict[str, Any] = {
        "model_name": found.model, "use_multimodal": False, "normalize_embedding_logits": True,
        "sliding_window_size": int(c["sliding_window"]), "global_head_dim": head_dim, "global_num_kv_heads": kv_heads,
        "share_kv_projections": found.k_eq_v, "v_norm_with_scale": False, "final_logits_soft_cap": float(softcap or 0),
        "local_rope_max_timescale": local_theta, "local_rope_proportion": local_fraction,
        "global_rope_max_timescale": global_theta, "global_rope_proportion": global_fraction,
        "hidden_size_per_layer_input": int(c.get("hidden_size_per_layer_input") or 0),
        "vocab_size_per_layer_input": int(c.get("vocab_size_per_layer_input") or 0) if found.per_layer_inputs else 0,
        "num_kv_shared_layers": int(c.get("num_kv_shared_layers") or 0), "use_double_wide_mlp": found.double_wide,
    }
    if found.moe:
        settings.update(num_experts=int(c["num_experts"]), num_experts_per_tok=int(c["top_k_experts"]),
                        base_moe_mlp_dim=int(c["moe_intermediate_size"]), shared_experts=1, norm_topk_prob=True)
    return settings


#: AutoTP for Gemma 4: DeepSpeed refuses transformers' plan (it lists "moe_tp_experts" entries even for the dense
#: models). Attention is split by heads (q/k norms whole, gradients summed over TP) and the MLP (column, then row).
#: The tied embedding and head, the per-layer-input embedding and its projections stay whole.
TENSOR_PARALLEL = partition_config(*ATTENTION_SPECS, *mlp_specs(r"mlp\."), QK_NORM_SPEC)

GEMMA4 = Family(name="gemma4",
                model_type="gemma4_text",
                rules=(),
                config_rules=_rules,
                untied_rules=LM_HEAD,
                query_scaled=False,
                rope_interleaved=False,
                maxtext_model="gemma4-31b",
                maxtext_extra=_maxtext_extra,
                layer_blocks=_blocks,
                tensor_parallel=TENSOR_PARALLEL)

FAMILIES = (GEMMA4, )
