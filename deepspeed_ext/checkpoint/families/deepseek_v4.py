"""DeepSeek-V4 (HF ``deepseek_v4``): every layer a mixture of experts under manifold-constrained hyper-connections.

What sets it apart from DeepSeek-V3:

* the residual stream is ``hc_mult`` parallel streams; each layer mixes them in and out of attention and of the MoE
  block through a hyper-connection (``attn_hc`` / ``ffn_hc``: ``fn``, ``base``, ``scale``), and ``model.hc_head``
  collapses them before the final norm;
* attention has one key/value head shared by every query head (``kv_proj``, keys and values alike), a low-rank
  query (``q_a_proj`` -> ``q_a_norm`` -> ``q_b_proj``), a learned sink per head (``sinks``) and a grouped low-rank
  output (``o_a_proj``: ``o_groups`` blocks of heads, each to ``o_lora_rank``; then ``o_b_proj``). Sliding-window
  layers have nothing more; compressed layers add a compressor that pools windows of tokens into extra keys
  (``kv_proj``, ``gate_proj``, ``position_bias``, ``kv_norm``); the compressed sparse ones (CSA) also an indexer
  that picks the pooled keys each query reads (``compressor.indexer``, whose choice is an index: no gradient
  reaches its weights);
* the first ``mlp_layer_types == "hash_moe"`` layers route by a table from token id to experts (``mlp.gate.tid2eid``,
  an int64 buffer a checkpoint carries); the others by top-k over sqrt-softplus scores with DeepSeek's router bias
  (``e_score_correction_bias``); every layer adds one shared expert (``shared_experts``).

Files: transformers 5.22 reads DeepSeek's release naming (``layers.<i>.attn.wq_a.weight``, ``embed.weight``,
``head.weight``, ``hc_head_fn``; FP8 weights with E8M0 scales in a ``.scale`` beside them, the experts FP4) through
its conversion mapping, and ``save_pretrained`` writes that naming under ``model.``, with the model's names left for
the embedding, the final norm and ``hc_head`` (the mapping's anchored patterns do not turn back). :data:`HF_NAMES`
maps the model to save_pretrained's naming (what to-hf writes); :data:`RELEASE_PREFIXES` the release's to it. The
release's multi-token-prediction layers are ``mtp.<i>.*``. ``to-hf --like RELEASE --quantize fp8`` writes the
release's own format back (:func:`deepspeed_ext.checkpoint.hf.quantized.release_quantize_plan`).

MaxText 0.2.5's ``deepseek4-284b`` (decoder ``deepseek4``) holds it. Unscanned, every layer is ``layers_<i>``;
scanned, the hash-routed layers stay so and the rest must be MaxText's fixed blocks of a heavily compressed layer (at
compression 128) then a compressed sparse one, stacked on axis 1 as ``scanned_blocks/layers_0`` / ``layers_1``. Each
hyper-connection's ``fn`` / ``base`` / ``scale`` splits into MaxText's pre / post / residual parts (``mhc_attention``,
``mhc_mlp``: ``pre_alpha`` [N·H, N], ``res_alpha`` [N·H, N²], ``res_beta`` [N, N], ``pre_alpha_scale`` [1], ...);
MaxText's ``mhc_norm`` scale, which transformers' weightless norm lacks, is written as ones and read back only while
it is ones. Attention: ``wkv`` [H, 1, D], ``wq_b`` [q_lora, heads, D], ``o_a_proj`` [groups, heads·D / groups,
o_lora_rank], ``sinks``, ``hca_compressor`` or ``csa_compressor`` (with its ``indexer``, whose ``q_proj`` is
transformers' ``q_b_proj``). The router bias sits in ``MoEBiasVar`` (stacked on axis 0), the hash table in
``Tid2EidVar``, in float32 whatever the checkpoint's dtype, checked to hold expert indices, read back as int64.
Refused for MaxText in one line (:func:`maxtext_layout`): RoPE other than plain (the release's yarn on the compressed
layers), compressed sparse layers at another compression than 4, hash-routed layers that are not the first ones,
softmax router scores, hc_eps or rms_norm_eps other than MaxText's fixed 1e-6. Not caught by any config check:
MaxText's shared expert does not clip its SwiGLU inputs at ``swiglu_limit`` (its routed experts do, as transformers'
both do), so logits agree while those inputs stay within the limit.
"""

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from deepspeed_ext.checkpoint.families import (EXPERT, LAYER, LAYERS, ExpertSplit, Family, LayerBlock, Rule,
                                               partition_config)
from deepspeed_ext.checkpoint.families.llama import EMBEDDING_AND_NORM, HEAD_SPEC, LM_HEAD, mlp_specs
from deepspeed_ext.errors import CheckpointError

_L = f"model.layers.{LAYER}"

#: (the model's name, save_pretrained's) under a decoder layer.
_LAYER_NAMES = (
    ("input_layernorm.weight", "attn_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    *((f"{block}_hc.{part}", f"hc_{block}_{part}") for block in ("attn", "ffn") for part in ("fn", "base", "scale")),
    ("self_attn.sinks", "attn.attn_sink"),
    ("self_attn.q_a_proj.weight", "attn.wq_a.weight"),
    ("self_attn.q_a_norm.weight", "attn.q_norm.weight"),
    ("self_attn.q_b_proj.weight", "attn.wq_b.weight"),
    ("self_attn.kv_proj.weight", "attn.wkv.weight"),
    ("self_attn.kv_norm.weight", "attn.norm.weight"),
    ("self_attn.o_a_proj.weight", "attn.wo_a.weight"),
    ("self_attn.o_b_proj.weight", "attn.wo_b.weight"),
    ("self_attn.compressor.position_bias", "attn.compressor.ape"),
    ("self_attn.compressor.kv_proj.weight", "attn.compressor.wkv.weight"),
    ("self_attn.compressor.gate_proj.weight", "attn.compressor.wgate.weight"),
    ("self_attn.compressor.kv_norm.weight", "attn.compressor.norm.weight"),
    ("self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"),
    ("self_attn.compressor.indexer.kv_proj.weight", "attn.indexer.compressor.wkv.weight"),
    ("self_attn.compressor.indexer.gate_proj.weight", "attn.indexer.compressor.wgate.weight"),
    ("self_attn.compressor.indexer.kv_norm.weight", "attn.indexer.compressor.norm.weight"),
    ("self_attn.compressor.indexer.q_b_proj.weight", "attn.indexer.wq_b.weight"),
    ("self_attn.compressor.indexer.scorer.weights_proj.weight", "attn.indexer.weights_proj.weight"),
    ("mlp.gate.weight", "ffn.gate.weight"),
    ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.gate.tid2eid", "ffn.gate.tid2eid"),
    ("mlp.shared_experts.gate_proj.weight", "ffn.shared_experts.w1.weight"),
    ("mlp.shared_experts.down_proj.weight", "ffn.shared_experts.w2.weight"),
    ("mlp.shared_experts.up_proj.weight", "ffn.shared_experts.w3.weight"),
)
_E = f"{_L}.ffn.experts.{EXPERT}"

#: The model's names against save_pretrained's files: each layer's tensors renamed, the fused experts one by one
#: (``w1`` the gate rows, ``w3`` the up rows, ``w2`` down), the output projection ``head.weight``. Read, not written:
#: the attention's key/value norm as DeepSeek's own code names it, ``attn.kv_norm`` (transformers reads both; its
#: save_pretrained writes ``attn.norm``, the compressors' spelling, which its mapping also turns into ``kv_norm``).
HF_NAMES = (
    *(ExpertSplit(f"{_L}.{model}", (f"{_L}.{stored}", )) for model, stored in _LAYER_NAMES),
    ExpertSplit(f"{_L}.self_attn.kv_norm.weight", (f"{_L}.attn.kv_norm.weight", )),
    ExpertSplit(f"{_L}.mlp.experts.gate_up_proj", (f"{_E}.w1.weight", f"{_E}.w3.weight")),
    ExpertSplit(f"{_L}.mlp.experts.down_proj", (f"{_E}.w2.weight", )),
    ExpertSplit("lm_head.weight", ("head.weight", )),
)

#: DeepSeek's release names its files without ``model.``, and its embedding, final norm and hc_head tensors as its
#: own code does (transformers' conversion mapping reads both namings).
RELEASE_PREFIXES = (("embed.weight", "model.embed_tokens.weight"), ("norm.weight", "model.norm.weight"),
                    ("hc_head_fn", "model.hc_head.hc_fn"), ("hc_head_base", "model.hc_head.hc_base"),
                    ("hc_head_scale", "model.hc_head.hc_scale"), ("layers.", "model.layers."))

#: AutoTP for DeepSeek-V4: DeepSpeed refuses transformers' plan for it ("packed_colwise", "moe_tp_experts"). The
#: shared experts are split (column, then row) and lm_head by vocabulary. Attention is split by its output groups of
#: heads, but not by AutoTP (whose layers would drop the grouped projection's blocks, and leave the key/value head
#: every query head reads with each rank's part of its gradient): deepspeed_ext.module_inject.grouped_attention_tp
#: cuts it after AutoTP's pass. The hyper-connections, the routers (and the hash table), the fused experts, the
#: norms and the embedding stay whole.
TENSOR_PARALLEL = partition_config(*mlp_specs(r"mlp\.shared_experts\."), HEAD_SPEC)

# --------------------------------------------------------------------------- MaxText (deepseek4-284b)
_D = f"decoder/{LAYERS}"
_A = f"{_D}/self_attention"
_MOE = f"{_D}/mlp/MoeBlock_0"
_PARTS = ("pre", "post", "res")


def _hyper_connection(block: str, module: str) -> tuple[Rule, ...]:
    """``{block}_hc``'s projection, bias and scales, each split into MaxText's pre / post / residual parts, and the
    norm scale MaxText has in front of them (see transforms' ``_hc_rows``)."""
    hf, maxtext = f"{_L}.{block}_hc", f"{_D}/{module}"
    return (*(Rule(f"{hf}.fn", f"{maxtext}/{part}_alpha", f"hc_{part}_alpha") for part in _PARTS),
            Rule(f"{hf}.fn", f"{maxtext}/mhc_norm/scale", "hc_norm"),
            *(Rule(f"{hf}.base", f"{maxtext}/{part}_beta", f"hc_{part}_beta") for part in _PARTS),
            *(Rule(f"{hf}.scale", f"{maxtext}/{part}_alpha_scale", f"hc_{part}_scale") for part in _PARTS))


def _compressor(hf: str, maxtext: str) -> tuple[Rule, ...]:
    return (Rule(f"{hf}.kv_proj.weight", f"{maxtext}/kv_proj/kernel", "linear"),
            Rule(f"{hf}.gate_proj.weight", f"{maxtext}/gate_proj/kernel", "linear"),
            Rule(f"{hf}.position_bias", f"{maxtext}/position_bias", "copy"),
            Rule(f"{hf}.kv_norm.weight", f"{maxtext}/kv_norm/scale", "copy"))


#: Every layer's: norms, hyper-connections, attention (the key/value head [H, 1, D], the query up-projection per head,
#: the grouped output projection per group), router weight, experts and shared expert.
LAYER_RULES = (
    Rule(f"{_L}.input_layernorm.weight", f"{_D}/pre_self_attention_layer_norm/scale", "copy"),
    Rule(f"{_L}.post_attention_layernorm.weight", f"{_D}/post_self_attention_layer_norm/scale", "copy"),
    *_hyper_connection("attn", "mhc_attention"),
    *_hyper_connection("ffn", "mhc_mlp"),
    Rule(f"{_L}.self_attn.q_a_proj.weight", f"{_A}/wq_a/kernel", "linear"),
    Rule(f"{_L}.self_attn.q_a_norm.weight", f"{_A}/q_norm/scale", "copy"),
    Rule(f"{_L}.self_attn.q_b_proj.weight", f"{_A}/wq_b/kernel", "head_rows"),
    Rule(f"{_L}.self_attn.kv_proj.weight", f"{_A}/wkv/kernel", "key"),
    Rule(f"{_L}.self_attn.kv_norm.weight", f"{_A}/kv_norm/scale", "copy"),
    Rule(f"{_L}.self_attn.sinks", f"{_A}/sinks", "copy"),
    Rule(f"{_L}.self_attn.o_a_proj.weight", f"{_A}/o_a_proj/kernel", "grouped_out"),
    Rule(f"{_L}.self_attn.o_b_proj.weight", f"{_A}/o_b_proj/kernel", "linear"),
    Rule(f"{_L}.mlp.gate.weight", f"{_MOE}/gate/kernel", "linear"),
    Rule(f"{_L}.mlp.experts.gate_up_proj", f"{_MOE}/wi_0", "expert_gate"),
    Rule(f"{_L}.mlp.experts.gate_up_proj", f"{_MOE}/wi_1", "expert_up"),
    Rule(f"{_L}.mlp.experts.down_proj", f"{_MOE}/wo", "expert_down"),
    Rule(f"{_L}.mlp.shared_experts.gate_proj.weight", f"{_D}/mlp/shared_experts/wi_0/kernel", "linear"),
    Rule(f"{_L}.mlp.shared_experts.up_proj.weight", f"{_D}/mlp/shared_experts/wi_1/kernel", "linear"),
    Rule(f"{_L}.mlp.shared_experts.down_proj.weight", f"{_D}/mlp/shared_experts/wo/kernel", "linear"),
)
_C = f"{_L}.self_attn.compressor"
#: A heavily compressed layer's compressor; a compressed sparse layer's, with its indexer (its own compressor at the
#: indexer's width, the query projection from the low-rank query, the per-head weights).
HCA = _compressor(_C, f"{_A}/hca_compressor")
CSA = (*_compressor(_C, f"{_A}/csa_compressor"), *_compressor(f"{_C}.indexer", f"{_A}/csa_compressor/indexer"),
       Rule(f"{_C}.indexer.q_b_proj.weight", f"{_A}/csa_compressor/indexer/q_proj/kernel", "linear"),
       Rule(f"{_C}.indexer.scorer.weights_proj.weight", f"{_A}/csa_compressor/indexer/weights_proj/kernel",
            "linear"))
#: The routers' state outside the optimizer: a hash layer's table in MaxText's float32 ``Tid2EidVar`` variable, a
#: top-k layer's bias in ``MoEBiasVar`` (stacked on axis 0 when scanned, as DeepSeek-V3's).
HASH = (Rule(f"{_L}.mlp.gate.tid2eid", f"{_MOE}/tid2eid", "expert_ids", collection="Tid2EidVar", scan_axis=0), )
TOP_K = (Rule(f"{_L}.mlp.gate.e_score_correction_bias", f"{_MOE}/gate/bias", "copy", collection="MoEBiasVar",
              scan_axis=0), )
#: The final collapse of the streams.
HYPER_HEAD = (Rule("model.hc_head.hc_fn", "decoder/hc_head/hc_fn", "linear"),
              Rule("model.hc_head.hc_base", "decoder/hc_head/hc_base", "copy"),
              Rule("model.hc_head.hc_scale", "decoder/hc_head/hc_scale", "copy"))

#: A layer's kind in MaxText's tree: its attention and its router, as transformers' config names them.
_ATTENTION = {"sliding_attention": "sliding", "compressed_sparse_attention": "csa",
              "heavily_compressed_attention": "hca"}
_ROUTER = {"hash_moe": "hash", "moe": "top_k"}
KINDS = tuple(f"{attention}/{router}" for attention in _ATTENTION.values() for router in _ROUTER.values())


def _in(rules: tuple[Rule, ...], part: str) -> tuple[Rule, ...]:
    """``rules`` for each layer kind with ``part`` (an attention or a router), once per kind."""
    return tuple(dataclasses.replace(rule, block=kind) for kind in KINDS if part in kind.split("/") for rule in rules)


MAXTEXT_RULES = (EMBEDDING_AND_NORM + HYPER_HEAD + LAYER_RULES + _in(HCA, "hca") + _in(CSA, "csa") +
                 _in(HASH, "hash") + _in(TOP_K, "top_k"))
#: The compression MaxText builds a compressed sparse layer at (it tells the two compressors apart by it), and the
#: heavily compressed layers' compression its scanned blocks are built with.
CSA_RATE, SCANNED_HCA_RATE = 4, 128
#: What MaxText's deepseek4 fixes that transformers' config sets: the hyper-connections' epsilon (also the hyper
#: head's RMSNorm epsilon, where transformers takes rms_norm_eps).
MAXTEXT_EPS = 1e-6


@dataclass(frozen=True)
class MaxTextLayout:
    """What MaxText's deepseek4 builds for a DeepSeek-V4 config, checked to compute what transformers computes."""

    kinds: tuple[str, ...]  # per layer, one of KINDS
    hash_layers: int  # the first layers, hash-routed
    compress_ratios: tuple[int, ...]  # per layer: 0 (sliding window only) or the compression
    config: Any  # transformers' config, as the model reads it


def maxtext_layout(c: Mapping[str, Any]) -> MaxTextLayout:
    """The config as transformers' model reads it (legacy spellings resolved, defaults filled in), refused in one
    line where MaxText 0.2.5's deepseek4 would compute something else."""
    from transformers import AutoConfig
    try:
        config = AutoConfig.for_model("deepseek_v4", **{key: value for key, value in c.items() if key != "model_type"})
    except Exception as exc:  # whatever transformers raises on a value it cannot take
        raise CheckpointError(f"deepseek-v4: the model config is not one transformers reads: "
                              f"{' '.join(str(exc).split())}") from exc
    routers = [_ROUTER[kind] for kind in config.mlp_layer_types]
    hashed = routers.count("hash")
    problem = _unlike_maxtext(config, routers, hashed)
    if problem:
        raise CheckpointError(f"deepseek-v4: MaxText 0.2.5's deepseek4 does not compute this model as transformers "
                              f"does: {problem}")
    rates = tuple(config.compress_rates[kind] if kind != "sliding_attention" else 0 for kind in config.layer_types)
    kinds = tuple(f"{_ATTENTION[attention]}/{router}" for attention, router in zip(config.layer_types, routers,
                                                                                  strict=True))
    return MaxTextLayout(kinds, hashed, rates, config)


def _unlike_maxtext(config: Any, routers: list[str], hashed: int) -> str:
    """What of ``config`` MaxText's deepseek4 computes otherwise (empty: nothing)."""
    csa, hca = (config.compress_rates[kind] for kind in ("compressed_sparse_attention", "heavily_compressed_attention"))
    types = set(config.layer_types)
    ropes = config.rope_parameters
    if routers[:hashed] != ["hash"] * hashed:
        return "its hash-routed layers are not the first ones (MaxText hash-routes exactly the first layers)"
    if "compressed_sparse_attention" in types and csa != CSA_RATE:
        return f"its compressed sparse layers compress by {csa} (MaxText builds them at {CSA_RATE} only)"
    if "heavily_compressed_attention" in types and hca <= CSA_RATE:
        return f"its heavily compressed layers compress by {hca} (MaxText builds them above {CSA_RATE} only)"
    for label, rope in (("its RoPE", ropes["main"]), ("its compressed layers' RoPE", ropes["compress"])):
        if rope.get("rope_type", "default") != "default":
            return f"{label} is {rope['rope_type']} (MaxText rotates by plain RoPE only)"
    if config.scoring_func not in ("sqrtsoftplus", "sigmoid"):
        return (f"its router scores by {config.scoring_func} (MaxText normalizes the chosen experts' weights for "
                "sqrtsoftplus and sigmoid only)")
    if config.hidden_act != "silu":
        return f"its experts activate by {config.hidden_act} (MaxText: silu)"
    if config.hc_mult < 2:
        return "it has one residual stream (MaxText builds hyper-connections for 2 or more only)"
    if config.hc_eps != MAXTEXT_EPS or config.rms_norm_eps != MAXTEXT_EPS:
        return (f"hc_eps {config.hc_eps}, rms_norm_eps {config.rms_norm_eps} (MaxText fixes its hyper-connections' "
                f"epsilons and its hyper head's norm epsilon at {MAXTEXT_EPS})")
    return ""


def _blocks(c: Mapping[str, Any], scanned: bool) -> tuple[LayerBlock, ...]:
    """``layers_<i>`` each; scanned, the hash-routed layers stay ``layers_<i>`` and the rest are MaxText's scanned
    blocks of a heavily compressed layer (compression 128) then a compressed sparse one, stacked on axis 1:
    ``scanned_blocks/layers_0`` and ``scanned_blocks/layers_1``."""
    layout = maxtext_layout(c)
    count, hashed = len(layout.kinds), layout.hash_layers
    each = tuple(LayerBlock(f"layers_{i}", (i, ), False, kind) for i, kind in enumerate(layout.kinds))
    if not scanned:
        return each
    rest = layout.kinds[hashed:]
    cycle = ("hca/top_k", "csa/top_k")
    if rest != cycle * (len(rest) // 2) or (rest and layout.compress_ratios[hashed] != SCANNED_HCA_RATE):
        raise CheckpointError(f"decoder layers {hashed}-{count - 1} (those after the hash-routed ones) are not "
                              f"whole cycles of 2 (a heavily compressed layer at compression {SCANNED_HCA_RATE}, "
                              "then a compressed sparse one), which scanned MaxText needs for this family; write it "
                              "with --no-scan-layers")
    stacks = tuple(LayerBlock(f"scanned_blocks/layers_{j}", tuple(range(hashed + j, count, 2)), True, kind)
                   for j, kind in enumerate(cycle) if rest)
    return each[:hashed] + stacks


def _number(value: Any) -> Any:
    return int(value) if float(value).is_integer() else float(value)


def _maxtext_extra(c: Mapping[str, Any]) -> dict[str, Any]:
    layout = maxtext_layout(c)
    config = layout.config
    return {
        # One key/value head and one shared expert whatever the config says: transformers builds no other.
        "base_num_kv_heads": 1, "shared_experts": 1, "base_mlp_dim": config.moe_intermediate_size,
        "base_moe_mlp_dim": config.moe_intermediate_size, "num_experts": config.n_routed_experts,
        "num_experts_per_tok": config.num_experts_per_tok, "routed_score_func": config.scoring_func,
        "routed_bias": True, "routed_scaling_factor": config.routed_scaling_factor,
        "mlp_activations_limit": config.swiglu_limit, "first_num_hash_layers": layout.hash_layers,
        "compress_ratios": list(layout.compress_ratios), "mhc_expansion_rate": config.hc_mult,
        "sinkhorn_iterations": config.hc_sinkhorn_iters, "q_lora_rank": config.q_lora_rank,
        "o_groups": config.o_groups, "o_lora_rank": config.o_lora_rank, "qk_rope_head_dim": config.qk_rope_head_dim,
        "indexer_n_heads": config.index_n_heads, "indexer_head_dim": config.index_head_dim,
        "indexer_topk": config.index_topk, "sliding_window_size": config.sliding_window,
        "rope_max_timescale": _number(config.rope_parameters["main"]["rope_theta"]),
        "compressed_rope_max_timescale": _number(config.rope_parameters["compress"]["rope_theta"]),
        "max_position_embeddings": config.max_position_embeddings,
    }


DEEPSEEK_V4 = Family(name="deepseek-v4",
                     model_type="deepseek_v4",
                     rules=MAXTEXT_RULES,
                     untied_rules=LM_HEAD,
                     query_scaled=False,
                     rope_interleaved=False,
                     maxtext_model="deepseek4-284b",
                     maxtext_extra=_maxtext_extra,
                     layer_blocks=_blocks,
                     hf_expert_splits=HF_NAMES,
                     hf_release_prefixes=RELEASE_PREFIXES,
                     hf_mtp_prefix="mtp.",
                     tensor_parallel=TENSOR_PARALLEL,
                     # AutoEP's routers score by softmax or sigmoid and pick by top-k over the scores; V4 scores by
                     # sqrt(softplus) and its hash layers pick by token id (the MoE block takes input_ids).
                     expert_parallel=None)

FAMILIES = (DEEPSEEK_V4, )
