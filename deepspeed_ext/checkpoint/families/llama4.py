"""Llama 4 text (HF ``llama4_text``, the language model of Scout and Maverick): GQA attention with weightless
per-head q/k L2 norms, chunked attention, and RoPE left out of every ``no_rope_layer_interval``-th layer; the
feed-forward is dense or a routed block (one shared expert, ``num_experts_per_tok`` routed experts held fused as
``experts.gate_up_proj`` [E, H, 2I] and ``experts.down_proj`` [E, I, H]) as ``interleave_moe_layer_step`` says.
transformers' files use the model's names.

MaxText 0.2.5 ships ``llama4-17b-16e`` / ``llama4-17b-128e``; deepspeed-ext does not map them yet.
"""

from deepspeed_ext.checkpoint.families import Family
from deepspeed_ext.checkpoint.families.llama import ATTENTION_AND_HEAD_SPECS

#: AutoTP for Llama 4: DeepSpeed refuses transformers' plan ("packed_rowwise", "moe_tp_experts"). Attention, the dense
#: feed-forwards and the shared experts are split (column, then row); the router and the fused experts stay whole.
TENSOR_PARALLEL = {"partition_config": {
    "use_default_specs": False,
    "layer_specs": [
        *ATTENTION_AND_HEAD_SPECS,
        {"patterns": [r".*\.feed_forward\.(shared_expert\.)?(gate|up)_proj\.weight$"], "partition_type": "column"},
        {"patterns": [r".*\.feed_forward\.(shared_expert\.)?down_proj\.weight$"], "partition_type": "row"},
    ],
}}

LLAMA4 = Family(name="llama4",
                model_type="llama4_text",
                rules=(),
                query_scaled=False,
                rope_interleaved=False,
                maxtext_model=None,
                maxtext_note="MaxText 0.2.5 has llama4-17b-16e / llama4-17b-128e; deepspeed-ext does not map them yet",
                tensor_parallel=TENSOR_PARALLEL,
                # The MoE block adds the routed experts into the shared expert's (row-split) output in place.
                inplace_outputs=(r"layers\.\d+\.feed_forward\.shared_expert\.down_proj", ))

FAMILIES = (LLAMA4, )
