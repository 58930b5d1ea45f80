"""MaxText checkpoints in Orbax: the sink behind ``to-maxtext``, the source behind ``from-maxtext``, and
``reshard-orbax``. The conventions are in docs/maxtext.md.

Layout written (what MaxText loads with ``load_parameters_path=<out>/0/items``)::

    <out>/0/_CHECKPOINT_METADATA     custom_metadata {"scan_layers": bool, "deepspeed_ext": {family, model_config}}
    <out>/0/items/                   Orbax PyTree (OCDBT + zarr3, as MaxText writes it):
        {"step": N, "params": {"params": <MaxText parameter tree>},
         "opt_state": {} or optax adamw's [{"count", "mu", "nu"}, None, {"count"}]}

The parameter tree follows a :class:`~deepspeed_ext.checkpoint.families.Family`: HF ``(out, in)`` weights
are transposed to MaxText's ``(in, out)``, attention kernels are split per head, the query kernel of
families that bake it in is multiplied by 1/sqrt(head_dim) (in fp32), llama3.1's q/k heads are put in
adjacent-pair RoPE order, and with ``scan_layers`` per-layer leaves are stacked on axis 1.

Streaming: each leaf is a lazy proxy that Orbax materialises just before writing it, one leaf at a
time, and writes slab by slab: a block of an HF tensor's rows (about :data:`BLOCK_BYTES` of fp32) is read,
transformed and cast, and becomes one slab of the leaf, written as whole storage chunks (a scanned stack is
stored one layer thick). Peak memory is a few blocks, whatever the size of the largest tensor. bf16 is written
as ``ml_dtypes.bfloat16`` straight from the fp32 rows.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from deepspeed_ext.checkpoint import output
from deepspeed_ext.checkpoint.fingerprint import FINGERPRINTS_KEY, Fingerprint, Fingerprints
from deepspeed_ext.checkpoint.formats import ORBAX_ITEM
from deepspeed_ext.checkpoint.families import LAYER, LAYERS, Family, LayerBlock, Rule
from deepspeed_ext.checkpoint.source import (ADAM_STATES, MASTER_WEIGHTS, STEP, CheckpointSource, OpenOptions,
                                             SourceInfo, WriteOptions, finite_check, protected_paths,
                                             required_model_config)
from deepspeed_ext.errors import CheckpointError, MissingConfigError, first_line

if TYPE_CHECKING:  # torch only where tensors are handed over: reshard-orbax needs none
    from deepspeed_ext.checkpoint.hf import ConfigFit
    from deepspeed_ext.checkpoint.tensor import FiniteCheck, LogicalTensor, RecordCheck, StreamCheck
    from deepspeed_ext.module_inject.layout import TPLayout

ITEM = ORBAX_ITEM
METADATA_KEY = "deepspeed_ext"  # our entry in the step's custom metadata
STEP_DIR = "0"
DTYPES = ("bfloat16", "float32")


# --------------------------------------------------------------------------- model dimensions
@dataclass(frozen=True)
class ModelDims:
    """What the transforms need from the model config."""

    num_layers: int
    head_dim: int
    tied: bool
    hidden_size: int = 0
    num_heads: int = 0
    #: The model's dtype as its config names it ("bfloat16", "float32", ...; "" when the config has none).
    dtype: str = ""
    #: The HF config itself (for layer blocks that depend on it, e.g. DeepSeek's dense layers).
    config: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    @classmethod
    def from_config(cls, config: Mapping[str, Any], source: str = "model config") -> ModelDims:
        try:
            heads = int(config["num_attention_heads"])
            head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
            return cls(num_layers=int(config["num_hidden_layers"]),
                       head_dim=head_dim,
                       tied=bool(config.get("tie_word_embeddings", False)),
                       hidden_size=int(config["hidden_size"]),
                       num_heads=heads,
                       dtype=str(config.get("dtype") or config.get("torch_dtype") or ""),
                       config=dict(config))
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{source}: incomplete model config ({exc}); pass --config config.json") from exc


# --------------------------------------------------------------------------- transforms (HF -> MaxText)
def _interleave(x: np.ndarray) -> np.ndarray:
    """HF rotate-half order -> adjacent pairs along the last (head_dim) axis: new[2i]=x[i], new[2i+1]=x[i+D/2]."""
    half = x.shape[-1] // 2
    return np.stack([x[..., :half], x[..., half:]], axis=-1).reshape(x.shape)


def _query_scale(head_dim: int) -> np.float32:
    # Computed in fp32: np.sqrt of a Python int would promote the kernel to float64.
    scale: np.float32 = np.float32(1.0) / np.sqrt(np.float32(head_dim))
    return scale


def _deinterleave(x: np.ndarray) -> np.ndarray:
    """Adjacent pairs -> HF rotate-half order (evens, then odds) along the last axis."""
    return np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


@dataclass(frozen=True)
class Transform:
    """HF tensor -> MaxText leaf (per layer), the leaf's shape from the HF shape, and the way back.

    ``inverse`` returns the HF tensor, or for a rule that holds part of one (``join_axis`` set), that part;
    the parts of one HF tensor are concatenated on ``join_axis`` in rule order, or with ``interleaved``
    alternate element by element along it (gpt-oss's gate/up columns).

    Adam moments: where the weight's transform scales values by s (a pre-scaled query kernel, gemma3's scaled
    embedding) or adds a constant (gemma3's 1 + w norms), MaxText's parameter is s·p + c, so its gradient is
    the HF one / s: the first moment takes 1/s and the second 1/s², and a constant changes neither.
    ``moments`` names the transform that only rearranges (the weight's without scale or shift) and
    ``moment_factor`` gives 1/s or 1/s² for a state.
    """

    forward: Callable[[np.ndarray, ModelDims, Family], np.ndarray]
    shape: Callable[[tuple[int, ...], ModelDims], tuple[int, ...]]
    inverse: Callable[[np.ndarray, ModelDims, Family], np.ndarray]
    hf_shape: Callable[[tuple[int, ...]], tuple[int, ...]]  # of what ``inverse`` returns, from the leaf shape
    join_axis: int | None = None
    interleaved: bool = False
    moments: str | None = None  # None: a moment takes ``forward`` itself
    moment_factor: Callable[[ModelDims, Family, str], np.float32] | None = None
    #: Streaming: the axis of the leaf (one layer's) that the HF tensor's rows (axis 0) become, so a block of
    #: HF rows is a slab of the leaf along it (None: the leaf is produced whole). ``row_unit``: HF rows per step
    #: along that axis (a head's rows for per-head reshapes). ``heads_in_rows``: ``forward`` takes the head
    #: count from ``dims.num_heads``, which for a block is the number of heads it holds.
    row_axis: int | None = None
    row_unit: Callable[[tuple[int, ...], ModelDims], int] = lambda s, d: 1
    heads_in_rows: bool = False


def _heads_in(x: np.ndarray, dims: ModelDims) -> np.ndarray:
    return x.T.reshape(x.shape[1], -1, dims.head_dim)  # (heads*D, H) -> (H, heads, D)


def _query(x: np.ndarray, dims: ModelDims, family: Family) -> np.ndarray:
    q = _heads_in(x, dims)
    if family.rope_interleaved:
        q = _interleave(q)
    if family.query_scaled:
        q = q * _query_scale(dims.head_dim)
    return q


def _key(x: np.ndarray, dims: ModelDims, family: Family) -> np.ndarray:
    k = _heads_in(x, dims)
    return _interleave(k) if family.rope_interleaved else k


def _heads_out(x: np.ndarray) -> np.ndarray:
    return x.reshape(x.shape[0], -1).T  # (H, heads, D) -> (heads*D, H)


def _query_inverse(q: np.ndarray, dims: ModelDims, family: Family) -> np.ndarray:
    if family.query_scaled:
        q = q * np.sqrt(np.float32(dims.head_dim))  # fp32: the round trip is exact to 1 ulp
    if family.rope_interleaved:
        q = _deinterleave(q)
    return _heads_out(q)


def _key_inverse(k: np.ndarray, dims: ModelDims, family: Family) -> np.ndarray:
    return _heads_out(_deinterleave(k) if family.rope_interleaved else k)


def _as_bias(forward: Callable[[np.ndarray, ModelDims, Family], np.ndarray],
             inverse: Callable[[np.ndarray, ModelDims, Family], np.ndarray]) -> Transform:
    """A q/k/v bias [heads*D] goes where its projection's output rows go: [heads, D], with the same RoPE
    order and query scale (it is a column of the projection, applied as one)."""
    return Transform(lambda x, d, f: forward(x[:, None], d, f)[0],
                     lambda s, d: (s[0] // d.head_dim, d.head_dim),
                     lambda x, d, f: inverse(x[None], d, f)[:, 0],
                     lambda s: (s[0] * s[1], ), row_axis=0, row_unit=_head_rows)


def _value(x: np.ndarray, dims: ModelDims, family: Family) -> np.ndarray:
    return _heads_in(x, dims)


def _value_inverse(x: np.ndarray, dims: ModelDims, family: Family) -> np.ndarray:
    return _heads_out(x)


def _expert_half(x: np.ndarray, second: bool) -> np.ndarray:
    inter = x.shape[1] // 2  # gate_up_proj [E, 2I, H]: gate rows first
    part = x[:, inter:, :] if second else x[:, :inter, :]
    return part.transpose(0, 2, 1)


def _embed_scale(dims: ModelDims) -> np.float32:
    """sqrt(hidden), as transformers' scaled embedding applies it: in the model's dtype (bf16 rounds it)."""
    scale = np.sqrt(np.float32(dims.hidden_size))
    if dims.dtype in ("bfloat16", "float16"):
        import ml_dtypes
        scale = np.float32(scale.astype(ml_dtypes.bfloat16 if dims.dtype == "bfloat16" else np.float16))
    return np.float32(scale)


#: Tensor states a leaf can hold: the fp32 master weights and Adam's two moments (universal names).
STATES = (MASTER_WEIGHTS, *ADAM_STATES)


def _moment_factor(dims: ModelDims, family: Family, state: str) -> np.float32:
    """How a query-kernel Adam moment scales between HF and MaxText.

    MaxText's query kernel is the HF one times s = 1/sqrt(D), so its gradient is the HF gradient / s:
    the first moment carries a factor 1/s = sqrt(D), the second 1/s^2 = D.
    """
    if not family.query_scaled:
        return np.float32(1.0)
    return np.sqrt(np.float32(dims.head_dim)) if state == "exp_avg" else np.float32(dims.head_dim)


def _embed_moment_factor(dims: ModelDims, family: Family, state: str) -> np.float32:
    scale = _embed_scale(dims)
    return np.float32(1.0) / (scale if state == "exp_avg" else scale * scale)


def to_maxtext(kind: str, x: np.ndarray, dims: ModelDims, family: Family, state: str = "fp32") -> np.ndarray:
    """One HF tensor (a weight or one of its Adam moments) in the layout of its MaxText leaf."""
    transform = TRANSFORMS[kind]
    if state != "fp32" and transform.moments is not None:
        factor = transform.moment_factor(dims, family, state) if transform.moment_factor else np.float32(1.0)
        return TRANSFORMS[transform.moments].forward(x, dims, family) * factor
    return transform.forward(x, dims, family)


def from_maxtext(kind: str, x: np.ndarray, dims: ModelDims, family: Family, state: str = "fp32") -> np.ndarray:
    """The inverse of :func:`to_maxtext` (for split tensors: this rule's part)."""
    transform = TRANSFORMS[kind]
    if state != "fp32" and transform.moments is not None:
        factor = transform.moment_factor(dims, family, state) if transform.moment_factor else np.float32(1.0)
        return TRANSFORMS[transform.moments].inverse(x / factor, dims, family)
    return transform.inverse(x, dims, family)


def _head_rows(s: tuple[int, ...], d: ModelDims) -> int:
    return d.head_dim


def _per_head_shape(s: tuple[int, ...], d: ModelDims) -> tuple[int, ...]:
    return (s[1], s[0] // d.head_dim, d.head_dim)


def _half_last(s: tuple[int, ...], d: ModelDims) -> tuple[int, ...]:
    return (*s[:-1], s[-1] // 2)


def _same(x: np.ndarray, d: ModelDims, f: Family) -> np.ndarray:
    return x


TRANSFORMS: dict[str, Transform] = {
    "copy": Transform(_same, lambda s, d: s, _same, lambda s: s, row_axis=0),
    "linear": Transform(lambda x, d, f: x.T, lambda s, d: (s[1], s[0]), lambda x, d, f: x.T, lambda s: (s[1], s[0]),
                        row_axis=1),
    "query": Transform(_query, _per_head_shape, _query_inverse, lambda s: (s[1] * s[2], s[0]), moments="key",
                       moment_factor=_moment_factor, row_axis=1, row_unit=_head_rows),
    "key": Transform(_key, _per_head_shape, _key_inverse, lambda s: (s[1] * s[2], s[0]), row_axis=1,
                     row_unit=_head_rows),
    "value": Transform(_value, _per_head_shape, _value_inverse, lambda s: (s[1] * s[2], s[0]), row_axis=1,
                       row_unit=_head_rows),
    "query_bias": dataclasses.replace(_as_bias(_query, _query_inverse), moments="key_bias",
                                      moment_factor=_moment_factor),
    "key_bias": _as_bias(_key, _key_inverse),
    "value_bias": _as_bias(_value, _value_inverse),
    "out": Transform(lambda x, d, f: x.T.reshape(-1, d.head_dim, x.shape[0]),
                     lambda s, d: (s[1] // d.head_dim, d.head_dim, s[0]),
                     lambda x, d, f: x.reshape(-1, x.shape[-1]).T,
                     lambda s: (s[2], s[0] * s[1]), row_axis=2),
    # Split per head by the head count (MLA: the B projections' and the output's head widths differ from the
    # config's head_dim): [heads*X, in] -> [in, heads, X] and [out, heads*X] -> [heads, X, out].
    "head_rows": Transform(lambda x, d, f: x.T.reshape(x.shape[1], d.num_heads, -1),
                           lambda s, d: (s[1], d.num_heads, s[0] // d.num_heads),
                           lambda x, d, f: x.reshape(x.shape[0], -1).T, lambda s: (s[1] * s[2], s[0]),
                           row_axis=1, row_unit=lambda s, d: s[0] // d.num_heads, heads_in_rows=True),
    "head_columns": Transform(lambda x, d, f: x.T.reshape(d.num_heads, -1, x.shape[0]),
                              lambda s, d: (d.num_heads, s[1] // d.num_heads, s[0]),
                              lambda x, d, f: x.reshape(-1, x.shape[-1]).T, lambda s: (s[2], s[0] * s[1]),
                              row_axis=2),
    # gemma3: MaxText stores RMSNorm scales as 1 + w and the embedding pre-multiplied by sqrt(hidden).
    "norm_plus_one": Transform(lambda x, d, f: x + np.float32(1.0), lambda s, d: s,
                               lambda x, d, f: x - np.float32(1.0), lambda s: s, moments="copy", row_axis=0),
    "embed_scaled": Transform(lambda x, d, f: x * _embed_scale(d), lambda s, d: s,
                              lambda x, d, f: x / _embed_scale(d), lambda s: s, moments="copy",
                              moment_factor=_embed_moment_factor, row_axis=0),
    # transformers' fused experts [E, 2I, H] (gate rows, then up rows) and [E, H, I] -> MaxText's [E, in, out].
    "expert_gate": Transform(lambda x, d, f: _expert_half(x, False), lambda s, d: (s[0], s[2], s[1] // 2),
                             lambda x, d, f: x.transpose(0, 2, 1), lambda s: (s[0], s[2], s[1]), join_axis=1,
                             row_axis=0),
    "expert_up": Transform(lambda x, d, f: _expert_half(x, True), lambda s, d: (s[0], s[2], s[1] // 2),
                           lambda x, d, f: x.transpose(0, 2, 1), lambda s: (s[0], s[2], s[1]), join_axis=1,
                           row_axis=0),
    "expert_down": Transform(lambda x, d, f: x.transpose(0, 2, 1), lambda s, d: (s[0], s[2], s[1]),
                             lambda x, d, f: x.transpose(0, 2, 1), lambda s: (s[0], s[2], s[1]), row_axis=0),
    # gpt-oss: experts already [E, in, out]; gate and up alternate along the last axis (weights and biases).
    "even_columns": Transform(lambda x, d, f: x[..., 0::2], _half_last, _same, lambda s: s, join_axis=-1,
                              interleaved=True, row_axis=0),
    "odd_columns": Transform(lambda x, d, f: x[..., 1::2], _half_last, _same, lambda s: s, join_axis=-1,
                             interleaved=True, row_axis=0),
}


def join_parts(kind: str, parts: list[np.ndarray]) -> np.ndarray:
    """The HF tensor from the inverses of its rules' leaves (one part unless the transform splits it)."""
    transform = TRANSFORMS[kind]
    if transform.join_axis is None:
        return parts[0]
    if transform.interleaved:
        axis = transform.join_axis % parts[0].ndim
        return np.stack(parts, axis=axis + 1).reshape(
            *parts[0].shape[:axis], -1, *parts[0].shape[axis + 1:])
    return np.concatenate(parts, axis=transform.join_axis)


# --------------------------------------------------------------------------- sharding
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
    "shared_experts/wi_0/kernel": ("embed", "mlp"),
    "shared_experts/wi_1/kernel": ("embed", "mlp"),
    "shared_experts/wo/kernel": ("mlp", "embed"),
    "gate/kernel": ("embed", None),
    "gate/bias": (None, ),
    "wi_0": ("exp", "embed_moe", "mlp_moe"),  # routed experts (moe_block, MoeBlock_0, GptOssMlp)
    "wi_1": ("exp", "embed_moe", "mlp_moe"),
    "wo": ("exp", "mlp_moe", "embed_moe"),
    "wi_0_bias": ("exp", None),
    "wi_1_bias": ("exp", None),
    "wo_bias": ("exp", None),
}

#: Logical axis -> mesh axis (MaxText base.yml logical_axis_rules, first choice; norms kept whole).
MESH_RULES: dict[str, str | None] = {
    "embed": "fsdp", "embed_vocab": "fsdp", "embed_moe": "fsdp",
    "vocab": "tensor", "heads": "tensor", "q_heads": "tensor", "kv_heads": "tensor", "mlp": "tensor",
    "mlp_moe": "tensor", "exp": "expert", "layers": "stage", "norm": None, "kv": None, "kv_head_dim": None,
}


def logical_axes(leaf: Leaf) -> tuple[str | None, ...]:
    name = leaf.name
    matches = [suffix for suffix in LOGICAL_AXES if name == suffix or name.endswith("/" + suffix)]
    if not matches:
        raise CheckpointError(f"internal: no logical axes for MaxText leaf {name!r}")
    axes = LOGICAL_AXES[max(matches, key=len)]
    return (*axes[:leaf.scan_axis], "layers", *axes[leaf.scan_axis:]) if leaf.stacked else axes


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
    return tuple(1 if axis == leaf.scan_axis else size for axis, size in enumerate(chunk or leaf.shape))


#: How much of an HF tensor ``to-maxtext`` transforms and writes at a time: HF rows of about this many fp32 bytes.
#: A block is held a few times over (read, transformed, stored dtype, read back for the fingerprint), so the peak
#: stays a few hundred MiB whatever the tensor's size (Llama-3 8B's embedding is 2 GiB in fp32).
BLOCK_BYTES = 32 << 20


@dataclass(frozen=True)
class RowBlocks:
    """How one HF tensor is streamed into its leaf (one layer of it, for a scanned stack).

    Blocks of whole ``unit``s of HF rows (a head's rows for per-head reshapes) become slabs of the leaf along
    ``axis``; ``chunk`` is the storage chunk's extent along it and ``step`` the units per block, a multiple of
    ``chunk``, so every write covers whole chunks and tensorstore never reads back or rewrites one. ``axis``
    None: produced and written whole.
    """

    axis: int | None
    unit: int = 1
    units: int = 1
    chunk: int = 1
    step: int = 1

    def ranges(self) -> Iterator[tuple[int, int]]:
        """The blocks as ``[first, last)`` units along ``axis``."""
        for first in range(0, self.units, self.step):
            yield first, min(self.units, first + self.step)


def row_blocks(kind: str, state: str, hf_shape: tuple[int, ...], dims: ModelDims,
               device_shard: tuple[int, ...] | None, block_bytes: int = BLOCK_BYTES) -> RowBlocks:
    """The streaming plan for an HF tensor of ``hf_shape`` under transform ``kind``: blocks of about
    ``block_bytes`` of fp32 HF rows.

    ``device_shard``: the shape of one device's shard of the leaf (one layer's, for a stack) under the mesh,
    or None (no mesh: the chunk is the block). Under a mesh a chunk is split further only by a divisor of the
    device's shard along the streamed axis, so each chunk still belongs to one device.
    """
    transform = TRANSFORMS[kind]
    if state != "fp32" and transform.moments is not None:
        transform = TRANSFORMS[transform.moments]  # what the moment goes through (same layout, no shift)
    if transform.row_axis is None or not hf_shape:
        return RowBlocks(None)
    unit = transform.row_unit(hf_shape, dims)
    if unit <= 0 or hf_shape[0] % unit:
        return RowBlocks(None)
    units = hf_shape[0] // unit
    unit_bytes = unit * math.prod(hf_shape[1:]) * 4
    wanted = max(1, block_bytes // max(1, unit_bytes))  # units per block
    chunk_extent = None if device_shard is None else device_shard[transform.row_axis]
    if chunk_extent is None:
        chunk = min(units, wanted)
    elif chunk_extent <= wanted:
        chunk = chunk_extent
    else:  # the device's shard is larger than a block: split it by its largest divisor that fits
        chunk = max(d for d in range(1, wanted + 1) if chunk_extent % d == 0)
        if chunk * 8 < wanted:  # no divisor near the block size: keep the device's shard whole
            chunk = chunk_extent
    return RowBlocks(transform.row_axis, unit, units, chunk, max(1, wanted // chunk) * chunk)


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


# --------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Leaf:
    """One MaxText leaf to write: its path, shape, and where its data comes from."""

    path: tuple[str, ...]  # under params/<collection>
    shape: tuple[int, ...]
    rule: Rule | None  # None: a leaf reshard-orbax re-chunks (it needs only the path and shape)
    layers: tuple[int, ...] | None  # the decoder layers it holds; None for a global parameter
    stacked: bool = False  # scanned: ``layers`` stacked on ``scan_axis``
    collection: str = "params"  # MaxText's variable collection (params/<collection>/...)
    scan_axis: int = 1

    @property
    def name(self) -> str:
        return "/".join(self.path)


def layer_blocks(family: Family, dims: ModelDims, scan_layers: bool) -> tuple[LayerBlock, ...]:
    return family.layer_blocks(dims.config or {"num_hidden_layers": dims.num_layers}, scan_layers)


def rule_blocks(rule: Rule, blocks: Iterable[LayerBlock]) -> list[LayerBlock]:
    """The layer blocks a per-layer rule has a leaf in."""
    return [block for block in blocks if rule.block is None or rule.block == block.kind]


def plan_leaves(family: Family, dims: ModelDims, hf_shapes: Mapping[str, tuple[int, ...]], scan_layers: bool,
                source: str = "source") -> list[Leaf]:
    """Every MaxText leaf of the model, checked against the source's parameters in both directions."""
    rules = family.rules_for(dims.tied)
    blocks = layer_blocks(family, dims, scan_layers)
    used: set[str] = set()
    leaves = []
    for rule in rules:
        mine = rule_blocks(rule, blocks) if rule.per_layer else []
        names = [rule.hf.replace(LAYER, str(layer)) for block in mine for layer in block.layers] \
            if rule.per_layer else [rule.hf]
        missing = [name for name in names if name not in hf_shapes]
        if missing:
            raise CheckpointError(f"{source}: family {family.name!r} expects {missing[0]!r}"
                                  f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}, which the "
                                  "checkpoint does not have; wrong --family?")
        if not names:
            continue
        used.update(names)
        transform = TRANSFORMS[rule.kind]
        shapes = {transform.shape(tuple(hf_shapes[name]), dims) for name in names}
        if len(shapes) != 1:
            raise CheckpointError(f"{source}: {rule.hf} has different shapes across layers: {sorted(shapes)}")
        (shape, ) = shapes
        if not rule.per_layer:
            leaves.append(Leaf(tuple(rule.path.split("/")), shape, rule, None, collection=rule.collection))
            continue
        for block in mine:
            path = tuple(rule.path.replace(LAYERS, block.path).split("/"))
            if block.stacked:
                axis = rule.scan_axis
                leaves.append(Leaf(path, (*shape[:axis], len(block.layers), *shape[axis:]), rule, block.layers,
                                   stacked=True, collection=rule.collection, scan_axis=axis))
            else:
                leaves.append(Leaf(path, shape, rule, block.layers, collection=rule.collection))
    unmapped = sorted(set(hf_shapes) - used)
    if unmapped:
        raise CheckpointError(f"{source}: {len(unmapped)} parameters have no place in family {family.name!r} "
                              f"(e.g. {unmapped[:3]}); wrong --family?")
    return leaves


# --------------------------------------------------------------------------- loading in MaxText
def _rope_theta(config: Mapping[str, Any]) -> float | None:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if isinstance(rope, Mapping) and isinstance(rope.get("full_attention"), Mapping):
        rope = rope["full_attention"]  # per layer type (gemma3): the global layers' RoPE
    theta = (rope.get("rope_theta") if isinstance(rope, Mapping) else None) or config.get("rope_theta")
    return float(theta) if theta is not None else None


def maxtext_settings(family: Family, config: Mapping[str, Any], scan_layers: bool = True) -> dict[str, Any]:
    """The MaxText config (``KEY=VALUE`` overrides) that builds the model of HF ``config`` for a checkpoint
    written with ``family``: the family's MaxText model_name with the sizes overridden
    (``override_model_config``), and the family's own switches. MaxText's own model code is run with exactly
    these in tests/e2e/test_maxtext_model_code.py."""
    dims = ModelDims.from_config(config)
    settings: dict[str, Any] = {
        "model_name": family.maxtext_model, "override_model_config": True, "scan_layers": scan_layers,
        "base_emb_dim": dims.hidden_size, "base_num_query_heads": dims.num_heads,
        "base_num_kv_heads": int(config.get("num_key_value_heads") or dims.num_heads), "head_dim": dims.head_dim,
        "base_mlp_dim": config.get("intermediate_size"), "base_num_decoder_layers": dims.num_layers,
        "vocab_size": config.get("vocab_size"), "normalization_layer_epsilon": config.get("rms_norm_eps"),
        "logits_via_embedding": dims.tied,
        # Tied logits are x @ embedding.T as transformers computes them; gemma3 (which MaxText stores
        # pre-scaled) turns the 1/sqrt(hidden) normalization back on.
        "normalize_embedding_logits": False if dims.tied else None,
    }
    theta = _rope_theta(config)
    if theta is not None:
        settings["rope_max_timescale"] = int(theta) if float(theta).is_integer() else theta
    if family.maxtext_extra is not None:
        settings.update(family.maxtext_extra(config))
    return {key: value for key, value in settings.items() if value is not None}


def settings_text(settings: Mapping[str, Any]) -> str:
    """``KEY=VALUE ...`` as MaxText's command line takes them (booleans as true/false)."""
    def text(value: Any) -> str:
        if isinstance(value, bool):
            return str(value).lower()
        if isinstance(value, (list, tuple)):
            return "[" + ",".join(text(v) for v in value) + "]"
        return str(value)
    return " ".join(f"{key}={text(value)}" for key, value in settings.items())


# --------------------------------------------------------------------------- lazy leaves for Orbax
class LazyLeaf:
    """A numpy-like stand-in Orbax accepts as a leaf; the data is produced only when written.

    ``write_shape`` is the storage chunk (zarr3 chunk). The data comes whole from ``produce``, or from
    ``slabs``: an iterator of ``(index, array)`` pieces that together cover the leaf, each covering whole
    storage chunks, so the writer writes them one by one (no chunk is read back or rewritten) and never holds
    the leaf: a scanned stack a layer at a time, a large tensor a block of rows at a time.
    """

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype, produce: Callable[[], np.ndarray] | None,
                 write_shape: tuple[int, ...] | None = None,
                 slabs: Callable[[], Iterator[tuple[tuple[int | slice, ...], np.ndarray]]] | None = None):
        if (produce is None) == (slabs is None):
            raise CheckpointError("internal: a lazy leaf needs exactly one of `produce` and `slabs`")
        self.shape = tuple(shape)
        self.write_shape = tuple(write_shape) if write_shape else None
        self.slabs = slabs
        self.dtype = np.dtype(dtype)
        self.ndim = len(self.shape)
        self.size = math.prod(self.shape)
        self.nbytes = self.size * self.dtype.itemsize
        self._produce = produce

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        if self._produce is not None:
            array = self._produce()
        else:  # asked for whole (the writer normally takes it slab by slab)
            assert self.slabs is not None
            array = np.empty(self.shape, dtype=self.dtype)
            for index, piece in self.slabs():
                array[index] = piece
        if array.shape != self.shape or array.dtype != self.dtype:
            raise CheckpointError(f"internal: produced {array.shape} {array.dtype}, planned {self.shape} {self.dtype}")
        return array if dtype is None else array.astype(dtype)


_registered = False


def _register_lazy_leaf() -> None:
    global _registered
    if not _registered:
        from orbax.checkpoint import type_handlers

        from deepspeed_ext.checkpoint.orbax_private import lazy_leaf_handler
        type_handlers.register_type_handler(LazyLeaf, lazy_leaf_handler(), override=True)
        _registered = True


# --------------------------------------------------------------------------- sink
@dataclass(frozen=True)
class MaxTextOptions(WriteOptions):
    """``family``: the MaxText model family (None: inferred from the model config); ``scan_layers``: stack the
    decoder layers as MaxText's ``scan_layers=true`` expects; ``dtype`` of the weights; ``mesh``: the target
    mesh the storage chunks are cut for (``{"fsdp": 16}`` or ``"fsdp=16"``); ``with_optimizer``: also write
    the Adam moments as optax adamw's state."""

    family: str | None = None
    scan_layers: bool = True
    dtype: str = "bfloat16"
    mesh: Mapping[str, int] | str | None = None
    with_optimizer: bool = False


def write(source: CheckpointSource, out: str | Path, options: MaxTextOptions = MaxTextOptions()) -> Path:
    """Write ``source`` as a MaxText Orbax checkpoint at ``out``; returns ``out/0/items`` (MaxText's
    ``load_parameters_path``). One tensor is read when Orbax writes the leaf that needs it."""
    from deepspeed_ext.checkpoint.families import get_family, infer_family
    from deepspeed_ext.checkpoint.hf import ConfigFit
    from deepspeed_ext.checkpoint.tensor import record_check
    info = source.info
    label = str(info.given)
    config = required_model_config(info)
    family = get_family(options.family) if options.family else infer_family(config)
    tensors = {tensor.name: tensor for tensor in source.tensors()}
    fit = ConfigFit(config, {name: tuple(t.shape) for name, t in tensors.items()}, label)

    def load(name: str, state: str = MASTER_WEIGHTS) -> np.ndarray:
        return tensors[name].load_tensor(state).detach().float().numpy()

    last_whole: dict[tuple[str, str], Any] = {}

    def load_rows(name: str, state: str, first: int, last: int) -> Any:
        """Rows ``[first, last)`` as a flat fp32 tensor of their own (the source's blocks may be views of a mapped
        file that the next read releases); a source that cannot read ranges loads the tensor once for its blocks."""
        import torch
        tensor = tensors[name]
        row = math.prod(tensor.shape[1:])
        if tensor.range_loader is None:
            if (name, state) not in last_whole:
                last_whole.clear()
                last_whole[(name, state)] = tensor.load_tensor(state).detach().float().reshape(-1)
            return last_whole[(name, state)][first * row:last * row]
        rows = torch.empty((last - first) * row, dtype=torch.float32)
        offset = 0
        for block in tensor.blocks(state, first * row, last * row):  # each copied before the next is read
            rows[offset:offset + block.numel()].copy_(block.detach().reshape(-1))
            offset += block.numel()
        return rows

    with fit.first():  # a config that does not fit is named before what follows from it
        optimizer_step = None
        if options.with_optimizer:
            first = next(iter(tensors.values()))
            if STEP not in first.states:
                raise CheckpointError(f"{label}: no optimizer step to carry (--with-optimizer)")
            value = first.load(STEP)
            optimizer_step = int(value.item() if hasattr(value, "item") else value)
        mesh = parse_mesh(options.mesh) if isinstance(options.mesh, str) else options.mesh
        return write_maxtext(load, {name: t.shape for name, t in tensors.items()},
                             family,
                             ModelDims.from_config(config),
                             out,
                             scan_layers=options.scan_layers,
                             dtype=options.dtype,
                             overwrite=options.overwrite,
                             progress=options.progress,
                             source=label,
                             model_config=config,
                             step=info.global_step,
                             mesh=mesh,
                             with_optimizer=options.with_optimizer,
                             optimizer_step=optimizer_step,
                             finite=finite_check(source, options),
                             recorded=record_check(info),
                             fit=fit,
                             protect=protected_paths(source, options),
                             load_rows=load_rows,
                             before_publish=source.raise_if_damaged)


def write_maxtext(load: Callable[..., np.ndarray],
                  hf_shapes: Mapping[str, tuple[int, ...]],
                  family: Family,
                  dims: ModelDims,
                  out: str | Path,
                  *,
                  scan_layers: bool = True,
                  dtype: str = "bfloat16",
                  overwrite: bool = False,
                  progress: bool = True,
                  source: str = "source",
                  model_config: Mapping[str, Any] | None = None,
                  step: int = 0,
                  mesh: Mapping[str, int] | None = None,
                  with_optimizer: bool = False,
                  optimizer_step: int | None = None,
                  finite: FiniteCheck | None = None,
                  recorded: RecordCheck | None = None,
                  fit: ConfigFit | None = None,
                  protect: Iterable[str | Path] = (),
                  load_rows: Callable[[str, str, int, int], Any] | None = None,
                  block_bytes: int | None = None,
                  before_publish: Callable[[], None] | None = None) -> Path:
    """Write a MaxText Orbax checkpoint at ``out`` from HF-named fp32 tensors; returns ``out/0/items``.

    ``model_config`` (the HF config) is stored in the step's custom metadata beside ``scan_layers``, so
    ``from-maxtext`` needs no ``--config`` for checkpoints written here. ``step`` (the training step the
    weights are from) goes into the tree's ``step`` leaf, which MaxText ignores for a parameter load and
    ``from-maxtext`` hands back to DeepSpeed so a resumed run continues its step count and data order.

    ``mesh`` (e.g. ``{"fsdp": 16}``): each array's storage chunks are one device's shard under MaxText's
    sharding rules for that mesh (one layer thick for scanned stacks, see :func:`storage_chunk`), so a
    restore into that mesh reads each shard's bytes once, with no separate reshard pass.

    ``with_optimizer``: ``opt_state`` also holds the Adam moments in the layout of MaxText's default
    optimizer (optax ``adamw``: ``[ScaleByAdamState(count, mu, nu), EmptyState, ScaleByScheduleState(count)]``,
    ``mu``/``nu`` mirroring ``params`` and kept in fp32), with ``count`` = ``optimizer_step``. The query
    moments are rescaled for MaxText's pre-scaled query kernel (see :func:`_moment_factor`).

    ``load(name, state)`` returns one full fp32 tensor (``state``: ``fp32``, ``exp_avg`` or ``exp_avg_sq``) as
    numpy; ``load_rows(name, state, first, last)`` rows ``[first, last)`` of it (along axis 0), flattened, as
    numpy or a torch tensor. Tensors are streamed into their leaves in blocks of about ``block_bytes``
    (default :data:`BLOCK_BYTES`) of fp32 rows (:func:`row_blocks`), read with ``load_rows`` (default: cut from
    ``load``, which then loads the whole tensor for each block: for sources held in memory), when Orbax writes
    the leaf that needs them. ``finite``: check every tensor for NaN/Inf; if any has them, the written
    checkpoint is removed and nothing is left.
    ``recorded``: likewise, check what ``load`` returns against the fingerprints the source recorded.
    ``fit``: the check that the tensors fit transformers' model for the config, running on a thread: polled
    at each load, and its answer awaited before anything is published.
    ``protect``: the source's paths, which the output may not touch; the output is built aside and published
    whole (:mod:`deepspeed_ext.checkpoint.output`).
    """
    import ml_dtypes
    from tqdm import tqdm

    if dtype not in DTYPES:
        raise CheckpointError(f"--dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)
    out = output.prepare(out, protect, overwrite=overwrite)  # absolute: OCDBT refuses relative paths
    leaves = plan_leaves(family, dims, hf_shapes, scan_layers, source)  # validates before anything is written
    states = STATES if with_optimizer else STATES[:1]
    block_bytes = BLOCK_BYTES if block_bytes is None else block_bytes
    checks = [check for check in (finite, recorded, fit) if check is not None]
    for check in checks:
        load = check.loader(load)
    if load_rows is None:
        whole = load

        def load_rows(name: str, state: str, first: int, last: int) -> np.ndarray:
            return np.asarray(whole(name, state))[first:last].reshape(-1)
    else:
        load_rows = _checked_rows(load_rows, checks, hf_shapes)
    # Fingerprints of what a read of this checkpoint returns (each array as stored, undone from MaxText's layout
    # in fp32, as from-maxtext does), so a reader can check the arrays exactly: per HF tensor and state, one
    # fingerprint per part (a fused tensor's halves sit in two leaves), added up once every array is written.
    read_back = _ReadBackFingerprints()
    bar = tqdm(total=len(leaves) * len(states), desc="to-maxtext", unit="array", disable=not progress)

    def stored_block(rule: Rule, name: str, state: str, leaf_dtype: np.dtype, plan: RowBlocks, first: int,
                     last: int) -> np.ndarray:
        """Units ``[first, last)`` of HF tensor ``name`` in the leaf's layout and dtype (all of it where the plan
        streams nothing); its read-back fingerprint is recorded as it goes."""
        hf_shape = tuple(hf_shapes[name])
        if plan.axis is None:
            array = np.asarray(load(name, state), dtype=np.float32)
            block_dims, low = dims, 0
        else:
            low, high = first * plan.unit, last * plan.unit
            rows = load_rows(name, state, low, high)
            rows = rows.detach().numpy() if hasattr(rows, "detach") else rows  # a torch tensor
            array = np.asarray(rows, dtype=np.float32).reshape(high - low, *hf_shape[1:])
            # A per-head reshape that takes the head count from dims sees only this block's heads.
            block_dims = dataclasses.replace(dims, num_heads=last - first) \
                if TRANSFORMS[rule.kind].heads_in_rows else dims
        stored = np.ascontiguousarray(to_maxtext(rule.kind, array, block_dims, family, state), dtype=leaf_dtype)
        del array
        read_back.add(name, state, rule, low,
                      from_maxtext(rule.kind, stored.astype(np.float32), block_dims, family, state))
        return stored

    def lazy_leaf(leaf: Leaf, state: str, leaf_dtype: np.dtype) -> LazyLeaf:
        rule = leaf.rule
        assert rule is not None  # plan_leaves gives every leaf its rule
        layers = leaf.layers or ()
        names = [rule.hf] if leaf.layers is None else [rule.hf.replace(LAYER, str(layer)) for layer in layers]
        if leaf.stacked and leaf.scan_axis != 1:  # small non-parameter variables stacked on axis 0: whole

            def produce_stack() -> np.ndarray:
                plan = RowBlocks(None)
                array = np.stack([stored_block(rule, name, state, leaf_dtype, plan, 0, 1) for name in names],
                                 leaf.scan_axis)
                bar.update(1)
                return array

            return LazyLeaf(leaf.shape, leaf_dtype, produce_stack, shard_shape(leaf, mesh) if mesh else None)

        # The leaf of one tensor (one layer's, for a stack on axis 1): its storage chunk without the layer axis.
        chunk = list(storage_chunk(leaf, mesh) or leaf.shape)
        if leaf.stacked:
            del chunk[1]
        else:
            names = names[:1]  # an unscanned layer's leaf holds its one layer
        per_mesh = shard_shape(leaf, mesh) if mesh else None
        if per_mesh is not None and leaf.stacked:
            per_mesh = per_mesh[:1] + per_mesh[2:]
        plan = row_blocks(rule.kind, state, tuple(hf_shapes[names[0]]), dims, per_mesh, block_bytes)
        if plan.axis is not None:
            chunk[plan.axis] = plan.chunk
        stack_axis = 1 if leaf.stacked else None
        write_shape = tuple(chunk[:1] + [1] + chunk[1:]) if leaf.stacked else tuple(chunk)

        def slabs() -> Iterator[tuple[tuple[int | slice, ...], np.ndarray]]:
            for position, name in enumerate(names):
                for first, last in plan.ranges() if plan.axis is not None else [(0, 1)]:
                    index: list[int | slice] = [slice(None)] * (len(leaf.shape) - (stack_axis is not None))
                    if plan.axis is not None:
                        index[plan.axis] = slice(first, last)
                    if stack_axis is not None:
                        index.insert(stack_axis, position)
                    yield tuple(index), stored_block(rule, name, state, leaf_dtype, plan, first, last)
            bar.update(1)

        return LazyLeaf(leaf.shape, leaf_dtype, None, write_shape, slabs=slabs)

    def lazy_tree(state: str) -> dict[str, Any]:
        """``{collection: tree}``; the moments only of the ``params`` collection (the optimizer's)."""
        # Moments stay fp32 (optax's mu_dtype defaults to MaxText's fp32 weight_dtype).
        leaf_dtype = np_dtype if state == "fp32" else np.dtype(np.float32)
        tree: dict[str, Any] = {}
        for leaf in leaves:
            if state != "fp32" and leaf.collection != "params":
                continue
            node = tree.setdefault(leaf.collection, {})
            for key in leaf.path[:-1]:
                node = node.setdefault(key, {})
            node[leaf.path[-1]] = lazy_leaf(leaf, state, leaf_dtype)
        return tree

    opt_state: Any = {}
    if with_optimizer:
        count = np.int32(step if optimizer_step is None else optimizer_step)
        adam = {"count": count, "mu": lazy_tree("exp_avg"), "nu": lazy_tree("exp_avg_sq")}
        opt_state = [adam, None, {"count": count}]
    tree = {"step": int(step), "params": lazy_tree("fp32"), "opt_state": opt_state}

    custom = {"scan_layers": scan_layers,
              METADATA_KEY: {"family": family.name, "model_config": dict(model_config or {})}}

    def finish(partial: Path) -> None:
        if finite is not None:
            finite.raise_if_any()
        if recorded is not None:
            recorded.raise_if_wrong()
        if fit is not None:
            fit.result()
        if before_publish is not None:  # the source's own checks (its files' checksums)
            before_publish()
        _record_fingerprints(partial / STEP_DIR, read_back.total(step=optimizer_step if with_optimizer else None,
                                                                  global_steps=int(step)))

    try:
        with output.staged(out) as partial:
            _save_items(partial, tree, custom, finish=lambda: finish(partial))
    finally:
        bar.close()
    return out / STEP_DIR / ITEM


def _checked_rows(load_rows: Callable[[str, str, int, int], Any], checks: Sequence[StreamCheck],
                  hf_shapes: Mapping[str, tuple[int, ...]]) -> Callable[[str, str, int, int], Any]:
    """``load_rows`` with every block it returns seen by ``checks`` as the flat element range it is."""
    import torch

    def load(name: str, state: str, first: int, last: int) -> Any:
        rows = load_rows(name, state, first, last)
        value = rows if isinstance(rows, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(rows))
        row = math.prod(hf_shapes[name][1:])
        for check in checks:
            value = check.check_range(name, state, first * row, last * row, value)
        return value

    return load


class _ReadBackFingerprints:
    """Per HF tensor and state, the fingerprints of its parts as a read returns them, block by block (:meth:`add`
    runs on Orbax's writer threads: one dict store each, under the GIL); a block produced twice is counted once."""

    def __init__(self) -> None:
        self._parts: dict[tuple[str, str], dict[tuple[str, str, int], Fingerprint]] = {}

    def add(self, name: str, state: str, rule: Rule, first_row: int, read: np.ndarray) -> None:
        """``read``: the HF rows from ``first_row`` on of this rule's part (a block, or all of it)."""
        import torch

        # Sums do not see order: the elements as laid out in memory, with no copy for a transposed view.
        flat = np.ravel(read, order="K")
        self._parts.setdefault((name, state), {})[(rule.collection, rule.path, first_row)] = Fingerprint.of(
            torch.from_numpy(flat))

    def total(self, step: int | None, global_steps: int) -> Fingerprints:
        """The fingerprints of the whole tensors: a joined tensor's sums are its parts' sums added up."""
        found = Fingerprints(step=step, global_steps=global_steps)
        for (name, state), parts in sorted(self._parts.items()):
            found.add(name, state, Fingerprint(sum(p.numel for p in parts.values()),
                                               math.fsum(p.total for p in parts.values()),
                                               math.fsum(p.total_sq for p in parts.values())))
        return found


def _record_fingerprints(step_dir: Path, written: Fingerprints) -> None:
    """Add the fingerprints to our entry of the step's custom metadata, once every array is written (Orbax
    takes the custom metadata before it writes the arrays, whose tensors are read lazily)."""
    path = step_dir / "_CHECKPOINT_METADATA"
    data = json.loads(path.read_text())
    data.setdefault("custom_metadata", {}).setdefault(METADATA_KEY, {})[FINGERPRINTS_KEY] = written.to_json()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _save_items(out: Path, tree: dict[str, Any], custom_metadata: Mapping[str, Any],
                finish: Callable[[], None] | None = None) -> None:
    """Save ``tree`` (lazy leaves allowed) into the staging directory ``out`` as step 0, item ``items``, the
    way MaxText's own writers do, then its manifest; ``finish`` runs after the save (it may refuse it)."""
    import orbax.checkpoint as ocp
    _register_lazy_leaf()
    try:
        # MaxText's own storage choice: OCDBT + zarr3. Orbax writes the step into a temporary directory
        # and renames it when complete, so an interrupted run leaves no "0/" that looks finished.
        manager = ocp.CheckpointManager(
            out,
            item_names=(ITEM, ),
            item_handlers={ITEM: ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True)},
            options=ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False))
        manager.save(0, args=ocp.args.Composite(**{ITEM: ocp.args.PyTreeSave(tree)}),
                     custom_metadata=dict(custom_metadata))
        manager.wait_until_finished()
        manager.close()
        if finish is not None:
            finish()
        from deepspeed_ext.checkpoint.manifest import ManifestRecorder
        ManifestRecorder(out).write()
    except (ValueError, OSError) as exc:  # tensorstore reports failed writes (disk full) as ValueError
        raise CheckpointError(f"{out}: cannot write the Orbax checkpoint: {first_line(exc)}") from exc


# --------------------------------------------------------------------------- source
#: Where optax adamw's moments sit in MaxText's train state, relative to the item root.
MOMENT_PREFIX = {"exp_avg": ("opt_state", "0", "mu"), "exp_avg_sq": ("opt_state", "0", "nu")}
PARAMS_PREFIX = ("params", )


def restore_leaf(checkpointer: Any, items: Path, tree: Any, path: tuple[str, ...], restore_type: type,
                 dtype: Any = None) -> Any:
    """One leaf of a saved Orbax PyTree (``tree``: its metadata tree), through a partial restore.

    The request holds only ``path``, shaped like the saved tree: a saved list must be asked for at full
    length, with None for the entries not wanted.
    """
    import orbax.checkpoint as ocp

    def build(node: Any, depth: int, value: Any) -> Any:
        if depth == len(path):
            return value
        key = path[depth]
        if isinstance(node, (list, tuple)):
            out = [None] * len(node)
            out[int(key)] = build(node[int(key)], depth + 1, value)
            return out
        return {key: build(node[key], depth + 1, value)}

    item = build(tree, 0, np.empty(0) if restore_type is np.ndarray else 0)
    args = build(tree, 0, ocp.RestoreArgs(restore_type=restore_type, dtype=dtype))
    try:
        value = checkpointer.restore(items, args=ocp.args.PyTreeRestore(item=item, restore_args=args,
                                                                         partial_restore=True))
    except (ValueError, OSError) as exc:  # tensorstore reports corrupt or truncated data files as ValueError
        if restore_type is not np.ndarray:
            raise
        raise CheckpointError(f"{items}: cannot read array {'/'.join(path)}: {first_line(exc)}") from exc
    for key in path:
        value = value[int(key)] if isinstance(value, (list, tuple)) else value[key]
    return value


def open_source(path: Path, options: OpenOptions) -> CheckpointSource:
    """The format registry's reader (:mod:`deepspeed_ext.checkpoint.formats`): the checkpoint with its HF config
    and family, given, else what to-maxtext recorded."""
    from deepspeed_ext.checkpoint.families import get_family, infer_family
    from deepspeed_ext.checkpoint.formats import maxtext_items
    items = maxtext_items(path)
    if items is None:
        raise CheckpointError(f"{path}: not a MaxText (Orbax) checkpoint (no _METADATA, no <step>/items)")
    stored = stored_model_info(items)
    if options.model_config is not None:
        config = dict(options.model_config)
    elif stored.get("model_config"):
        config = stored["model_config"]
    else:
        raise MissingConfigError(f"{items}: no model config recorded with this MaxText checkpoint (it was not written "
                                 "by deepspeed-ext); pass --config config.json (the model's HF config)")
    family_name = options.family or stored.get("family")
    family = get_family(family_name) if family_name else infer_family(config)
    # The fingerprints to-maxtext recorded describe what a read returns with the recorded config and family;
    # another config (--config, --family) reads the arrays differently, so the record does not apply.
    recorded = stored.get(FINGERPRINTS_KEY)
    as_written = config == stored.get("model_config") and family.name == stored.get("family")
    fingerprints = (Fingerprints.from_json(recorded, f"{items.parent / '_CHECKPOINT_METADATA'} (custom_metadata)")
                    if recorded is not None and as_written else None)
    return MaxTextCheckpoint(items, family, config, given=path, fingerprints=fingerprints)


class MaxTextCheckpoint:
    """A MaxText Orbax checkpoint (``<root>/<step>/items``) as a stream of HF-named fp32 tensors.

    Arrays are read one leaf at a time through Orbax's partial restore; a scanned stack stays cached
    while its layers are handed out, with its two moments' stacks (and, for a fused expert tensor, the
    stacks of its other half), so memory stays at a few of the largest arrays. It plugs into the universal writer like a
    DeepSpeed source with a single TP rank. When the checkpoint has optax adamw's state (MaxText's
    default optimizer) its moments and count become the universal ``exp_avg`` / ``exp_avg_sq`` / step;
    otherwise the optimizer state is fresh (zero moments, step 0).
    """

    def __init__(self, items: str | Path, family: Family, model_config: Mapping[str, Any],
                 given: str | Path | None = None, fingerprints: Fingerprints | None = None):
        """``given``: the path the user named (the root, a step or the item directory); errors name it.
        ``fingerprints``: what to-maxtext recorded of the tensors a read returns, checked by the writers."""
        import orbax.checkpoint as ocp
        self.items = Path(items).absolute()
        self.given = Path(given) if given is not None else self.items
        if not (self.items / "_METADATA").is_file():
            hint = " (point at <root>/0/items)" if (self.items / STEP_DIR / ITEM / "_METADATA").is_file() else ""
            raise CheckpointError(f"{self.items}: not an Orbax checkpoint item directory (no _METADATA){hint}")
        self.tag_dir = self.items
        self.fingerprints = fingerprints
        self.family = family
        self.model_config = dict(model_config)
        self.dims = ModelDims.from_config(model_config, source="--config")
        self._checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True))
        try:
            metadata = ocp.PyTreeCheckpointer().metadata(self.items)
            if metadata is None or metadata.item_metadata is None:
                raise ValueError("_METADATA is unreadable or empty")
            self._tree = metadata.item_metadata.tree
            flat = ocp.tree.to_flat_dict(self._tree, sep="/")
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"{self.items / '_METADATA'}: cannot read the Orbax metadata: "
                                  f"{first_line(exc)}") from exc
        # Keys: the leaf under the tree's "params", "<collection>/<path>" ("params/decoder/...").
        params_prefix = "/".join(PARAMS_PREFIX) + "/"
        self.stored = {name[len(params_prefix):]: tuple(m.shape) for name, m in flat.items()
                       if name.startswith(params_prefix)}
        self.stored_dtypes = {name[len(params_prefix):]: str(m.dtype) for name, m in flat.items()
                              if name.startswith(params_prefix)}
        if not any(name.startswith("params/") for name in self.stored):
            raise CheckpointError(f"{self.items}: no params/params tree in the Orbax metadata")
        stacks = {block.path for block in layer_blocks(family, self.dims, True) if block.stacked}
        self.scan_layers = any(f"/{stack}/" in f"/{name}" for name in self.stored for stack in stacks)
        self._sources = self._plan()
        moments = {state: {name[len("/".join(prefix)) + 1:] for name in flat if name.startswith("/".join(prefix) + "/")}
                   for state, prefix in MOMENT_PREFIX.items()}
        self.has_optimizer = all(moments.values())
        optimized = {name for name in self.stored if name.startswith("params/")}
        if self.has_optimizer and any(names != optimized for names in moments.values()):
            raise CheckpointError(f"{self.items}: opt_state mu/nu do not mirror params (not optax adamw's state?)")
        self.step = self._read_scalar(("step", ))
        self.optimizer_step = self._read_scalar(("opt_state", "0", "count")) if self.has_optimizer else 0
        self._cache: dict[tuple[str, ...], np.ndarray] = {}

    @property
    def read_paths(self) -> list[Path]:
        """The checkpoint: the step directory (the item, its metadata) and, when the step sits in an Orbax
        checkpoint manager's root (``<root>/<step>/items``), the root with its manifest."""
        from deepspeed_ext.checkpoint import output
        step = self.items.parent
        return output.read_paths(step.parent if step.name.isdigit() else step)

    def _restore(self, path: tuple[str, ...], restore_type: type, dtype: Any = None) -> Any:
        return restore_leaf(self._checkpointer, self.items, self._tree, path, restore_type, dtype)

    def _read_scalar(self, path: tuple[str, ...]) -> int:
        try:
            return int(np.asarray(self._restore(path, int)))
        except (KeyError, IndexError, TypeError, ValueError, FileNotFoundError):
            return 0  # params-only checkpoints need no step

    def _plan(self) -> dict[str, list[tuple[Rule, str, int | None]]]:
        """HF name -> the (rule, leaf, layer index inside a stack) its parts come from, in rule order."""
        sources: dict[str, list[tuple[Rule, str, int | None]]] = {}
        blocks = layer_blocks(self.family, self.dims, self.scan_layers)
        for rule in self.family.rules_for(self.dims.tied):
            places: list[tuple[str, str, int | None]] = []
            if not rule.per_layer:
                places.append((rule.hf, f"{rule.collection}/{rule.path}", None))
            for block in rule_blocks(rule, blocks) if rule.per_layer else []:
                leaf = f"{rule.collection}/{rule.path.replace(LAYERS, block.path)}"
                for position, layer in enumerate(block.layers):
                    places.append((rule.hf.replace(LAYER, str(layer)), leaf, position if block.stacked else None))
            for hf, leaf, index in places:
                if leaf not in self.stored:
                    raise CheckpointError(f"{self.items}: MaxText leaf {leaf!r} (for {hf}) is missing; wrong "
                                          f"--family ({self.family.name}) or config?")
                sources.setdefault(hf, []).append((rule, leaf, index))
        used = {leaf for parts in sources.values() for _, leaf, _ in parts}
        extra = sorted(set(self.stored) - used)
        if extra:
            raise CheckpointError(f"{self.items}: {len(extra)} MaxText arrays have no place in family "
                                  f"{self.family.name!r} (e.g. {extra[:3]}); wrong --family or config?")
        return sources

    def _leaf(self, path: tuple[str, ...]) -> np.ndarray:
        if path not in self._cache:
            if len(self._cache) >= 6:  # weight + two moments, each possibly split in two (fused experts)
                self._cache.pop(next(iter(self._cache)))
            self._cache[path] = np.asarray(self._restore(path, np.ndarray, np.float32), dtype=np.float32)
        return self._cache[path]

    def _hf_shape(self, parts: list[tuple[Rule, str, int | None]]) -> tuple[int, ...]:
        shapes = []
        for rule, leaf, index in parts:
            shape = self.stored[leaf]
            if index is not None:
                shape = shape[:rule.scan_axis] + shape[rule.scan_axis + 1:]
            shapes.append(TRANSFORMS[rule.kind].hf_shape(shape))
        axis = TRANSFORMS[parts[0][0].kind].join_axis
        if axis is None:
            return shapes[0]
        axis %= len(shapes[0])
        return tuple(sum(s[axis] for s in shapes) if i == axis else d for i, d in enumerate(shapes[0]))

    def hf_tensor(self, name: str, state: str = "fp32") -> np.ndarray:
        """The full fp32 HF tensor ``name`` (or one of its Adam moments), undone from MaxText's layout."""
        prefix = PARAMS_PREFIX if state == "fp32" else MOMENT_PREFIX[state]
        pieces = []
        for rule, leaf, index in self._sources[name]:
            if state != "fp32" and rule.collection != "params":
                # Outside the optimizer (DeepSeek's router bias): no moments, as a never-stepped Adam has.
                pieces.append(np.zeros(self._hf_shape([(rule, leaf, index)]), np.float32))
                continue
            array = self._leaf((*prefix, *leaf.split("/")))
            if index is not None:
                array = np.take(array, index, axis=rule.scan_axis)
            pieces.append(from_maxtext(rule.kind, np.ascontiguousarray(array), self.dims, self.family, state))
        return np.ascontiguousarray(join_parts(self._sources[name][0][0].kind, pieces))

    @cached_property
    def layouts(self) -> dict[str, TPLayout]:
        from deepspeed_ext.module_inject.layout import TPLayout
        return {name: TPLayout.replicated(self._hf_shape(parts), 1) for name, parts in self._sources.items()}

    @cached_property
    def info(self) -> SourceInfo:
        # Without optax state there are only weights: the resuming optimizer starts fresh.
        states = (MASTER_WEIGHTS, *ADAM_STATES, STEP) if self.has_optimizer else (MASTER_WEIGHTS, )
        return SourceInfo(format="maxtext", given=self.given, path=self.items, layouts=self.layouts, states=states,
                          global_step=self.step, model_config=self.model_config,
                          versions={"source": f"maxtext ({self.family.name})"}, fingerprints=self.fingerprints)

    def tensors(self) -> Iterator[LogicalTensor]:
        import torch

        from deepspeed_ext.checkpoint.hf import torch_dtype
        from deepspeed_ext.checkpoint.tensor import LogicalTensor
        # Weights first, then each moment, so a cached scanned stack serves all its layers in a row.
        for name, layout in self.layouts.items():

            def loader(state: str, name: str = name) -> Any:
                if state == STEP:
                    return self.optimizer_step
                return torch.from_numpy(self.hf_tensor(name, state))

            leaf = self._sources[name][0][1]
            yield LogicalTensor(name=name, shape=layout.shape, layout=layout, states=self.info.states, loader=loader,
                                dtype=torch_dtype(self.stored_dtypes[leaf]))

    def raise_if_damaged(self) -> None:
        """Nothing to check as it streams: this format's files are checked by ``verify`` (a manifest, where
        deepspeed-ext wrote them)."""

    def summary(self) -> dict[str, Any]:
        return {
            "kind": "maxtext",
            "path": str(self.items),
            "family": self.family.name,
            "model_type": self.model_config.get("model_type"),
            "scan_layers": self.scan_layers,
            "arrays": len(self.stored),
            "tensor_dtypes": sorted(set(self.stored_dtypes.values())),
            "global_steps": self.step,
            "optimizer": "optax adamw (mu, nu)" if self.has_optimizer else "none",
            "optimizer_step": self.optimizer_step if self.has_optimizer else None,
            "num_parameters": sum(math.prod(layout.shape) for layout in self.layouts.values()),
            "maxtext_settings": self._settings_text(),
        }

    def _settings_text(self) -> str:
        try:
            return settings_text(maxtext_settings(self.family, self.model_config, self.scan_layers))
        except (CheckpointError, KeyError, TypeError, ValueError) as exc:
            return f"unknown ({first_line(exc)})"


def stored_model_info(items: str | Path) -> dict[str, Any]:
    """What to-maxtext recorded in the step's custom metadata (family, HF model config), or {}."""
    import orbax.checkpoint as ocp
    step_dir = Path(items).absolute().parent
    try:
        custom = ocp.StandardCheckpointer().metadata(step_dir).custom_metadata or {}
    except (FileNotFoundError, ValueError, KeyError):
        return {}
    return dict(custom.get(METADATA_KEY) or {})


# --------------------------------------------------------------------------- reshard
_PARAM_ROOTS = ("params/params/", "opt_state/0/mu/params/", "opt_state/0/nu/params/")
#: The decoder subtrees that hold scanned stacks (``decoder/<stack>/...``) in MaxText's families.
SCANNED_STACKS = ("layers", "dense_layers", "moe_layers")


def reshard_orbax(items: str | Path,
                  out: str | Path,
                  mesh: Mapping[str, int],
                  *,
                  overwrite: bool = False,
                  progress: bool = True,
                  protect: Iterable[str | Path] = ()) -> tuple[Path, list[str]]:
    """Re-chunk a MaxText Orbax checkpoint for a target mesh, holding one array at a time.

    Every array is read whole (one partial restore), and rewritten with its storage chunk set to one
    device's shard on ``mesh``, under MaxText's logical-axis rules. Params and optax adamw moments are
    both handled; scalars (step, counts) and the step's custom metadata are copied as they are. Returns
    the output item directory and the arrays whose logical axes are unknown, which are written whole.
    """
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    items = Path(items).absolute()
    if not (items / "_METADATA").is_file():
        raise CheckpointError(f"{items}: not an Orbax checkpoint item directory (no _METADATA)")
    step = items.parent
    out = output.prepare(out, [*protect, *output.read_paths(step.parent if step.name.isdigit() else step)],
                         overwrite=overwrite)
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True))
    tree = ocp.PyTreeCheckpointer().metadata(items).item_metadata.tree
    try:
        custom = ocp.StandardCheckpointer().metadata(items.parent).custom_metadata or {}
    except (FileNotFoundError, ValueError, KeyError):
        custom = {}
    arrays = [name for name, m in ocp.tree.to_flat_dict(tree, sep="/").items() if len(getattr(m, "shape", ())) > 0]
    bar = tqdm(total=len(arrays), desc="reshard-orbax", unit="array", disable=not progress)
    whole: list[str] = []

    def read(path: tuple[str, ...], dtype: np.dtype) -> Callable[[], np.ndarray]:

        def produce() -> np.ndarray:
            array = np.asarray(restore_leaf(checkpointer, items, tree, path, np.ndarray), dtype=dtype)
            bar.update(1)
            return np.ascontiguousarray(array)

        return produce

    def rebuild(node: Any, path: tuple[str, ...]) -> Any:
        if isinstance(node, Mapping):
            return {key: rebuild(value, (*path, key)) for key, value in node.items()}
        if isinstance(node, (list, tuple)):
            return [rebuild(value, (*path, str(i))) for i, value in enumerate(node)]
        if node is None:
            return None
        shape, dtype, name = tuple(node.shape), np.dtype(node.dtype), "/".join(path)
        if not shape:  # a scalar (step, an optimizer count): copied with its dtype
            value = restore_leaf(checkpointer, items, tree, path, int if dtype.kind in "iu" else float)
            return int(value) if dtype == np.int64 else dtype.type(value)
        root = next((r for r in _PARAM_ROOTS if name.startswith(r)), None)
        write_shape = None
        if root is not None:
            param = name[len(root):]
            parts = tuple(param.split("/"))
            leaf = Leaf(parts, shape, None, None, stacked=len(parts) > 2 and parts[1] in SCANNED_STACKS)
            try:
                write_shape = shard_shape(leaf, mesh)
            except CheckpointError:
                pass
        if write_shape is None:
            whole.append(name)
        return LazyLeaf(shape, dtype, read(path, dtype), write_shape)

    new_tree = rebuild(tree, ())
    try:
        with output.staged(out) as partial:
            _save_items(partial, new_tree, custom)
    finally:
        bar.close()
    return out / STEP_DIR / ITEM, whole
