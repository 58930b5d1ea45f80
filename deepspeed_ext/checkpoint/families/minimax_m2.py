"""MiniMax-M2 / M2.1 (HF ``minimax_m2``): GQA attention whose q/k RMSNorms span the whole projection, partial rotary,
and a routed expert block in every layer with a router bias (``e_score_correction_bias``, a buffer; sigmoid
scores). transformers holds the experts fused ([E, 2I, H], [E, H, I]) under ``mlp``; its files keep the release's
``block_sparse_moe.experts.<e>.w1|w3|w2.weight``, ``block_sparse_moe.gate.weight`` and
``block_sparse_moe.e_score_correction_bias``.

MaxText 0.2.5 has no MiniMax model: to-maxtext refuses the family.
"""

from deepspeed_ext.checkpoint.families import ExpertSplit, Family, partition_config
from deepspeed_ext.checkpoint.families.llama import HEAD_SPEC
from deepspeed_ext.checkpoint.families.mixtral import HF_FILES

_L = "model.layers.{layer}"

HF_NAMES = HF_FILES + (ExpertSplit(f"{_L}.mlp.e_score_correction_bias",
                                   (f"{_L}.block_sparse_moe.e_score_correction_bias", )), )

#: AutoTP for MiniMax-M2: its q/k norms normalize the whole q (k) projection, which no rank holding some heads can
#: compute, so attention stays whole; every layer's MLP is routed experts (fused, whole) behind a router (whole).
#: What is split is lm_head, by vocabulary.
TENSOR_PARALLEL = partition_config(HEAD_SPEC)

#: AutoEP: DeepSpeed 0.19.8 has no MiniMax-M2 preset (its minimax_m3 preset is for M3's clamped SwiGLU and shared
#: experts). Mixtral's fits M2's block once the router scores with a sigmoid; the router bias, held by the block,
#: is found where it is.
EXPERT_PARALLEL = {"preset_model": "mixtral", "score_func": "sigmoid"}

MINIMAX_M2 = Family(name="minimax-m2",
                    model_type="minimax_m2",
                    rules=(),
                    query_scaled=False,
                    rope_interleaved=False,
                    maxtext_model=None,
                    maxtext_note="MaxText 0.2.5 has no MiniMax model",
                    hf_expert_splits=HF_NAMES,
                    tensor_parallel=TENSOR_PARALLEL,
                    expert_parallel=EXPERT_PARALLEL,
                    # AutoEP moves the block's router bias into its router.
                    autoep_renamed=(("router.e_score_correction_bias", "e_score_correction_bias"), ))

FAMILIES = (MINIMAX_M2, )
