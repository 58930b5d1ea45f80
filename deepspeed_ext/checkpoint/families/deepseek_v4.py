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
release's multi-token-prediction layers are ``mtp.<i>.*``.

MaxText 0.2.5 has ``deepseek4-284b``; deepspeed-ext does not map it yet.
"""

from deepspeed_ext.checkpoint.families import EXPERT, LAYER, ExpertSplit, Family, partition_config
from deepspeed_ext.checkpoint.families.llama import HEAD_SPEC, mlp_specs

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

DEEPSEEK_V4 = Family(name="deepseek-v4",
                     model_type="deepseek_v4",
                     rules=(),
                     query_scaled=False,
                     rope_interleaved=False,
                     maxtext_model=None,
                     maxtext_note="MaxText 0.2.5 has deepseek4-284b; deepspeed-ext does not map it yet",
                     hf_expert_splits=HF_NAMES,
                     hf_release_prefixes=RELEASE_PREFIXES,
                     hf_mtp_prefix="mtp.",
                     tensor_parallel=TENSOR_PARALLEL,
                     # AutoEP's routers score by softmax or sigmoid and pick by top-k over the scores; V4 scores by
                     # sqrt(softplus) and its hash layers pick by token id (the MoE block takes input_ids).
                     expert_parallel=None)

FAMILIES = (DEEPSEEK_V4, )
