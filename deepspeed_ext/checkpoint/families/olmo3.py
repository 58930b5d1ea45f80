"""OLMo 3 (HF ``olmo3``): Llama-like attention with sliding-window and global layers, norms after attention and
after the MLP (no norm before them), and q/k RMSNorms over the whole projection (all heads at once).

MaxText 0.2.5 ships ``olmo3-7b`` / ``olmo3-32b``; deepspeed-ext does not map them yet.
"""

from deepspeed_ext.checkpoint.families import Family

#: AutoTP for OLMo 3: DeepSpeed refuses transformers' plan ("colwise_gather_output" / "rowwise_split_input" around the
#: q/k norms). Those norms normalize the whole q (k) projection, so a rank holding some heads cannot compute them:
#: attention stays whole. The MLP is split (column, then row) and lm_head by vocabulary.
TENSOR_PARALLEL = {"partition_config": {
    "use_default_specs": False,
    "layer_specs": [
        {"patterns": [r".*\.mlp\.(gate|up)_proj\.weight$"], "partition_type": "column"},
        {"patterns": [r".*\.mlp\.down_proj\.weight$"], "partition_type": "row"},
        {"patterns": [r"^lm_head\.weight$"], "partition_type": "column", "gather_output": True},
    ],
}}

OLMO3 = Family(name="olmo3",
               model_type="olmo3",
               rules=(),
               query_scaled=False,
               rope_interleaved=False,
               maxtext_model=None,
               maxtext_note="MaxText 0.2.5 has olmo3-7b / olmo3-32b; deepspeed-ext does not map them yet",
               tensor_parallel=TENSOR_PARALLEL)

FAMILIES = (OLMO3, )
