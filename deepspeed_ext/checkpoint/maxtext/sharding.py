"""Sharding: MaxText's logical axes per leaf and its rules onto mesh axes, so ``to-maxtext --mesh`` and
``reshard-orbax`` cut each array's storage chunks as one device's shard of the target mesh."""

from __future__ import annotations

from collections.abc import Mapping

from deepspeed_ext.checkpoint.maxtext.plan import Leaf
from deepspeed_ext.errors import CheckpointError


#: MaxText's logical axes per leaf (by path suffix), before the scan axis is inserted at 1.
LOGICAL_AXES: dict[str, tuple[str | None, ...]] = {
    "token_embedder/embedding": ("vocab", "embed"),
    "logits_dense/kernel": ("embed", "vocab"),
    "scale": ("norm", ),
    "query/kernel": ("embed", "q_heads", "kv"),
    "key/kernel": ("embed", "kv_heads", "kv_head_dim"),
    "value/kernel": ("embed", "kv_heads", "kv_head_dim"),
    "out/kernel": ("heads", "kv", "embed"),
    "query/bias": ("q_heads", "kv"),
    "key/bias": ("kv_heads", "kv_head_dim"),
    "value/bias": ("kv_heads", "kv_head_dim"),
    "out/bias": ("embed", ),
    "sinks": (None, ),
    "mlp/wi_0/kernel": ("embed", "mlp"),
    "mlp/wi_1/kernel": ("embed", "mlp"),
    "mlp/wo/kernel": ("mlp", "embed"),
    "wq_a/kernel": ("embed", None),  # MLA
    "wkv_a/kernel": ("embed", None),
    "wq_b/kernel": (None, "q_heads", "kv"),
    "wkv_b/kernel": (None, "kv_heads", "kv_head_dim"),
    "indexer/wk/kernel": ("embed", None),  # DeepSeek-V3.2's indexer (its wq_b is a wq_b/kernel above)
    "indexer/weights_proj/kernel": ("embed", "q_heads"),
    "indexer/k_norm/bias": ("norm", ),
    "shared_experts/wi_0/kernel": ("embed", "mlp"),
    "shared_experts/wi_1/kernel": ("embed", "mlp"),
    "shared_experts/wo/kernel": ("mlp", "embed"),
    "shared_expert/wi_0/kernel": ("embed", "mlp"),  # Qwen3-Next / Qwen3.5's one shared expert, and its gate
    "shared_expert/wi_1/kernel": ("embed", "mlp"),
    "shared_expert/wo/kernel": ("mlp", "embed"),
    "shared_expert_gate/kernel": ("embed", None),
    "attention/attention/out/kernel": ("mlp", "embed"),  # Qwen3-Next's gated attention: [heads * D, embed]
    "in_proj_qkvz/kernel": ("embed", "gdn_head"),  # gated DeltaNet
    "in_proj_ba/kernel": ("embed", "gdn_head"),
    "out_proj/kernel": ("gdn_head", "embed"),
    "conv1d/kernel": (None, None, None),
    "A_log": (None, ),
    "dt_bias": (None, ),
    "layer_scalar": (None, ),  # Gemma 4: per layer; its per-layer inputs; its MoE block's router scales
    "embed_tokens_per_layer": ("vocab", "embed_vocab"),
    "per_layer_model_projection/kernel": ("embed", "mlp"),
    "per_layer_input_gate/kernel": ("embed", "mlp"),
    "per_layer_projection/kernel": ("mlp", "embed"),
    "pre_forward_scale_2": ("embed", ),
    "per_expert_scale": ("exp", ),
    "gate/kernel": ("embed", None),
    "gate/bias": (None, ),
    "wi_0": ("exp", "embed_moe", "mlp_moe"),  # routed experts (moe_block, MoeBlock_0, GptOssMlp)
    "wi_1": ("exp", "embed_moe", "mlp_moe"),
    "wo": ("exp", "mlp_moe", "embed_moe"),
    # DeepSeek-V4: its one key/value head, grouped output projection, compressors (and the indexer's), the hash
    # table, and the hyper-connections' small weights (whole, as MaxText keeps them).
    "wkv/kernel": ("embed", "kv_heads", "kv_head_dim"),
    "o_a_proj/kernel": (None, "q_heads", None),
    "o_b_proj/kernel": (None, "embed"),
    "kv_proj/kernel": ("embed", None),
    "gate_proj/kernel": ("embed", None),
    "position_bias": (None, None),
    "indexer/q_proj/kernel": ("embed", None),
    "tid2eid": (None, None),
    **{name: (None, None) for name in ("pre_alpha", "post_alpha", "res_alpha", "res_beta", "hc_fn")},
    **{name: (None, ) for name in ("pre_beta", "post_beta", "pre_alpha_scale", "post_alpha_scale", "res_alpha_scale",
                                   "hc_base", "hc_scale")},
    "wi_0_bias": ("exp", None),
    "wi_1_bias": ("exp", None),
    "wo_bias": ("exp", None),
}

#: Logical axis -> mesh axis (MaxText base.yml logical_axis_rules, first choice; norms kept whole).
MESH_RULES: dict[str, str | None] = {
    "embed": "fsdp", "embed_vocab": "fsdp", "embed_moe": "fsdp",
    "vocab": "tensor", "heads": "tensor", "q_heads": "tensor", "kv_heads": "tensor", "mlp": "tensor",
    "mlp_moe": "tensor", "exp": "expert", "layers": "stage", "norm": None, "kv": None, "kv_head_dim": None,
    "gdn_head": "tensor",
}


def logical_axes(leaf: Leaf) -> tuple[str | None, ...]:
    name = leaf.name
    matches = [suffix for suffix in LOGICAL_AXES if name == suffix or name.endswith("/" + suffix)]
    if not matches:
        raise CheckpointError(f"internal: no logical axes for MaxText leaf {name!r}")
    axes = LOGICAL_AXES[max(matches, key=len)]
    if leaf.stacked:
        # A scan nested in a scan (Qwen3-Next's local layers): MaxText's inner axis ("local_layers") stays whole.
        stack = ("layers", *[None] * (leaf.stack_rank - 1))
        axes = (*axes[:leaf.scan_axis], *stack, *axes[leaf.scan_axis:])
    if len(axes) != len(leaf.shape):
        raise CheckpointError(f"internal: logical axes {axes} do not fit MaxText leaf {name!r} of shape {leaf.shape}")
    return axes


def partition_spec(leaf: Leaf, mesh_shape: Mapping[str, int]) -> tuple[str | None, ...]:
    """Per dimension, the mesh axis the dimension is split over (None: whole), for a target mesh.

    A dimension stays whole where its mesh axis is absent, of size 1, already used by an earlier
    dimension, or does not divide it.
    """
    spec: list[str | None] = []
    for axis, size in zip(logical_axes(leaf), leaf.shape, strict=True):
        mesh_axis = MESH_RULES.get(axis) if axis else None
        ways = mesh_shape.get(mesh_axis, 1) if mesh_axis else 1
        spec.append(mesh_axis if ways > 1 and size % ways == 0 and mesh_axis not in spec else None)
    return tuple(spec)


def shard_shape(leaf: Leaf, mesh_shape: Mapping[str, int]) -> tuple[int, ...]:
    """One device's shard of ``leaf`` on the mesh (the storage chunk that makes restores read it once)."""
    return tuple(size // mesh_shape[axis] if axis else size
                 for size, axis in zip(leaf.shape, partition_spec(leaf, mesh_shape), strict=True))


def storage_chunk(leaf: Leaf, mesh_shape: Mapping[str, int] | None) -> tuple[int, ...] | None:
    """The zarr3 shard ``to-maxtext`` writes ``leaf`` in: one device's shard on the mesh (None: the whole
    array), and for a scanned stack one layer thick, so it is produced and written a layer at a time."""
    chunk = shard_shape(leaf, mesh_shape) if mesh_shape else None
    if not leaf.stacked:
        return chunk
    return tuple(1 if axis in leaf.stack_axes else size for axis, size in enumerate(chunk or leaf.shape))



#: Every mesh axis MaxText's configs name (base.yml ``mesh_axes``, old and new releases): each is accepted. The
#: storage chunks follow MESH_RULES, which shard parameters over fsdp, tensor, expert and stage only: MaxText
#: never shards parameters over data (or diloco), and along the secondary axes of its rules (fsdp_transpose,
#: sequence, context*, tensor_transpose, tensor_sequence, autoregressive) a chunk stays whole. Values are the same
#: either way; a restore reads whole chunks and keeps its part.
MESH_AXES = ("diloco", "data", "stage", "fsdp", "fsdp_transpose", "sequence", "context", "context_usp_ulysses",
             "context_autoregressive", "tensor", "tensor_transpose", "tensor_sequence", "expert", "autoregressive")


def parse_mesh(text: str) -> dict[str, int]:
    """``fsdp=16,tensor=2`` -> ``{"fsdp": 16, "tensor": 2}`` (MaxText's ici_*_parallelism names)."""
    mesh: dict[str, int] = {}
    expected = f"expected comma-separated AXIS=N with AXIS one of {', '.join(MESH_AXES)} and N >= 1"
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = (s.strip() for s in part.partition("="))
        if name not in MESH_AXES or not value.isdigit() or int(value) < 1:
            raise CheckpointError(f"--mesh {text!r}: {expected}, got {part!r}")
        if name in mesh:
            raise CheckpointError(f"--mesh {text!r}: axis {name!r} given twice")
        mesh[name] = int(value)
    if not mesh:
        raise CheckpointError(f"--mesh {text!r}: empty; {expected} (e.g. fsdp=16,tensor=2)")
    return mesh
