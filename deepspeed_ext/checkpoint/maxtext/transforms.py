"""The HF <-> MaxText math: each transform takes an HF tensor (a weight or one of its Adam moments) to the layout
of its MaxText leaf and back, and says how a tensor is streamed into its leaf a block of rows at a time.

HF ``(out, in)`` weights are transposed to MaxText's ``(in, out)``, attention kernels are split per head, the
query kernel of families that bake it in is multiplied by 1/sqrt(head_dim) (in fp32), llama3.1's q/k heads are
put in adjacent-pair RoPE order; which transform each HF parameter takes is the family's (its rules' ``kind``).
The conventions are in docs/maxtext.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from deepspeed_ext.checkpoint.families import Family, num_experts
from deepspeed_ext.checkpoint.states import ADAM_STATES, MASTER_WEIGHTS
from deepspeed_ext.errors import CheckpointError


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


# --------------------------------------------------------------------------- the transforms
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
    #: Where ``forward`` is ``moments``'s rearrangement times a factor and nothing more, that factor (None: it
    #: also shifts, as gemma3's norms do, or only rearranges).
    scale: Callable[[ModelDims, Family], np.float32] | None = None
    #: Streaming: the axis of the leaf (one layer's) that the HF tensor's rows (axis 0) become, so a block of
    #: HF rows is a slab of the leaf along it (None: the leaf is produced whole). ``row_unit``: HF rows per step
    #: along that axis (a head's rows for per-head reshapes). ``heads_in_rows``: ``forward`` takes the head
    #: count from ``dims.num_heads``, which for a block is the number of heads it holds.
    row_axis: int | None = None
    row_unit: Callable[[tuple[int, ...], ModelDims], int] = lambda s, d: 1
    heads_in_rows: bool = False
    #: A transform of the HF tensors a rule fuses (:attr:`~deepspeed_ext.checkpoint.families.Rule.fused`, stacked
    #: on axis 0): each one's rows, so a read splits ``inverse``'s result back into them.
    fused_rows: Callable[[ModelDims], tuple[int, ...]] | None = None
    #: The HF tensor holds indices (an int64 buffer: DeepSeek-V4's hash-routing table) that MaxText keeps in a float32
    #: variable: stored in float32 whatever the checkpoint's dtype (bf16 holds integers only to 256), read back as
    #: int64.
    integer: bool = False

    @property
    def rearranges(self) -> bool:
        """Whether ``forward`` only moves elements (a weight without a scale or shift, whose moments take
        ``forward`` itself): what it stores holds the HF tensor's values, so their sums need no inverse."""
        return self.moments is None


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


def _indexer_heads(dims: ModelDims) -> int:
    return int(dims.config["index_n_heads"])


def _global_head_dim(dims: ModelDims) -> int:
    """Gemma 4's global (full-attention) layers: their heads' own size."""
    from deepspeed_ext.checkpoint.families.gemma4 import global_attention
    return global_attention(dims.config)[0]


def _deltanet_segments(dims: ModelDims, kind: str) -> tuple[int, ...]:
    """The row segments of Qwen3.5's separate gated-DeltaNet projections as a fused rule stacks them: q, k, v, z
    (``in_proj_qkv``, then ``in_proj_z``) or b, a (``in_proj_b``, ``in_proj_a``)."""
    c = dims.config
    keys = int(c["linear_num_key_heads"]) * int(c["linear_key_head_dim"])
    value_heads = int(c["linear_num_value_heads"])
    values = value_heads * int(c["linear_value_head_dim"])
    return (keys, keys, values, values) if kind == "qkvz" else (value_heads, value_heads)


def _by_key_head(x: np.ndarray, dims: ModelDims, kind: str) -> np.ndarray:
    """HF rows made of whole segments (each head after head) -> MaxText's ``[in, out]`` kernel whose columns are
    grouped per key head: key head h's share of every segment, in segment order (MaxText splits each group's
    projection so; a key head's share of v, z, b, a is the value heads that read it)."""
    heads = int(dims.config["linear_num_key_heads"])
    segments = np.split(x, np.cumsum(_deltanet_segments(dims, kind))[:-1])
    grouped = np.concatenate([segment.reshape(heads, -1, x.shape[1]) for segment in segments], axis=1)
    return grouped.reshape(-1, x.shape[1]).T


def _from_key_heads(x: np.ndarray, dims: ModelDims, kind: str) -> np.ndarray:
    """The inverse of :func:`_by_key_head`: the segments' rows, stacked."""
    heads = int(dims.config["linear_num_key_heads"])
    shares = [rows // heads for rows in _deltanet_segments(dims, kind)]
    grouped = x.T.reshape(heads, sum(shares), x.shape[0])
    return np.concatenate([share.reshape(-1, x.shape[0]) for share in
                           np.split(grouped, np.cumsum(shares)[:-1], axis=1)])


def _fused_deltanet(kind: str) -> Transform:
    """Qwen3.5's q, k, v, z (or b, a) projections -> MaxText's per-key-head ``in_proj_qkvz`` (``in_proj_ba``):
    made whole (a block of one tensor's rows is no block of the leaf)."""
    rows = ((lambda d: (sum(_deltanet_segments(d, kind)[:3]), _deltanet_segments(d, kind)[3])) if kind == "qkvz"
            else (lambda d: _deltanet_segments(d, kind)))
    return Transform(lambda x, d, f: _by_key_head(x, d, kind), lambda s, d: (s[1], s[0]),
                     lambda x, d, f: _from_key_heads(x, d, kind), lambda s: (s[1], s[0]), fused_rows=rows)


def _embed_scale(dims: ModelDims) -> np.float32:
    """sqrt(hidden), as transformers' scaled embedding applies it: in the model's dtype (bf16 rounds it)."""
    scale = np.sqrt(np.float32(dims.hidden_size))
    if dims.dtype in ("bfloat16", "float16"):
        import ml_dtypes
        scale = np.float32(scale.astype(ml_dtypes.bfloat16 if dims.dtype == "bfloat16" else np.float16))
    return np.float32(scale)


#: Tensor states a leaf can hold: the fp32 master weights and Adam's two moments (universal names).
STATES = (MASTER_WEIGHTS, *ADAM_STATES)


def _query_factor(dims: ModelDims, family: Family) -> np.float32:
    return _query_scale(dims.head_dim) if family.query_scaled else np.float32(1.0)


def exact_bf16_scale(kind: str, dims: ModelDims, family: Family) -> float | None:
    """The factor a leaf of this kind scales the weight by (1.0 where it only moves elements) where that factor is a
    power of two, else None. Scaling by a power of two commutes with rounding while the values stay normal, so
    such a leaf computed from the bf16 rounding of the weights holds the very bits it holds computed from the
    fp32 weights and rounded last: the caller makes sure that no nonzero weight scales below bf16's (float32's)
    smallest normal, 2**-126. Another factor (gemma3's sqrt(hidden) of 2560, a head dim of 128), or a shift,
    rounds twice."""
    transform = TRANSFORMS[kind]
    if transform.rearranges:
        return 1.0
    if transform.scale is None:
        return None
    factor = float(transform.scale(dims, family))
    return factor if factor > 0 and math.frexp(factor)[0] == 0.5 else None


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


def to_maxtext(kind: str, x: np.ndarray, dims: ModelDims, family: Family, state: str = MASTER_WEIGHTS) -> np.ndarray:
    """One HF tensor (a weight or one of its Adam moments) in the layout of its MaxText leaf."""
    transform = TRANSFORMS[kind]
    if state != MASTER_WEIGHTS and transform.moments is not None:
        factor = transform.moment_factor(dims, family, state) if transform.moment_factor else np.float32(1.0)
        return TRANSFORMS[transform.moments].forward(x, dims, family) * factor
    return transform.forward(x, dims, family)


def from_maxtext(kind: str, x: np.ndarray, dims: ModelDims, family: Family, state: str = MASTER_WEIGHTS) -> np.ndarray:
    """The inverse of :func:`to_maxtext` (for split tensors: this rule's part)."""
    transform = TRANSFORMS[kind]
    if state != MASTER_WEIGHTS and transform.moments is not None:
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


# DeepSeek-V4's hyper-connections: transformers holds one projection ``fn`` [(2 + N) * N, N * H] of the N streams (its
# rows the N "pre" weights, the N "post" ones, then the N x N residual mix, row-major), its bias ``base`` and three
# scales; MaxText one [N * H, out] kernel, one bias and one [1] scale per part, and an RMSNorm scale before them that
# transformers does not have (its norm has no weight): written as ones, read back only while they are ones.
def _hc_streams(dims: ModelDims) -> int:
    return int(dims.config.get("hc_mult") or 4)  # transformers' default


def _hc_rows(dims: ModelDims, part: str) -> slice:
    streams = _hc_streams(dims)
    return {"pre": slice(0, streams), "post": slice(streams, 2 * streams), "res": slice(2 * streams, None)}[part]


def _hc_width(rows: int, dims: ModelDims, part: str) -> int:
    return len(range(rows)[_hc_rows(dims, part)])


def _hc_alpha(part: str) -> Transform:
    return Transform(lambda x, d, f: x[_hc_rows(d, part)].T, lambda s, d: (s[1], _hc_width(s[0], d, part)),
                     lambda x, d, f: x.T, lambda s: (s[1], s[0]), join_axis=0)


def _hc_beta(part: str) -> Transform:
    if part == "res":  # the N x N mix
        return Transform(lambda x, d, f: x[_hc_rows(d, part)].reshape(_hc_streams(d), -1),
                         lambda s, d: (_hc_streams(d), ) * 2, lambda x, d, f: x.reshape(-1), lambda s: (s[0] * s[1], ),
                         join_axis=0)
    return Transform(lambda x, d, f: x[_hc_rows(d, part)], lambda s, d: (_hc_width(s[0], d, part), ), _same,
                     lambda s: s, join_axis=0)


def _hc_scale(index: int) -> Transform:
    return Transform(lambda x, d, f: x[index:index + 1], lambda s, d: (1, ), _same, lambda s: s, join_axis=0)


def _unit_norm(x: np.ndarray, dims: ModelDims, family: Family) -> np.ndarray:
    """MaxText's hyper-connection norm scale, which has no place in the HF model: nothing (no rows of ``fn``), and
    only while it is all ones (a MaxText run trains it)."""
    if not np.all(x == 1):
        raise CheckpointError("a MaxText hyper-connection norm scale (mhc_norm/scale) is not 1: DeepSeek-V4's "
                              "hyper-connections normalize without a weight, so the trained scale has no place in "
                              "the HF model")
    return np.zeros((0, x.shape[0]), np.float32)


def _expert_ids(x: np.ndarray, dims: ModelDims, integer: bool) -> np.ndarray:
    """DeepSeek-V4's hash-routing table (token id -> expert indices), checked to hold expert indices (so float32
    holds them exactly), as MaxText's float32 variable or as the HF int64 buffer."""
    experts = num_experts(dims.config)
    if x.size and not (np.isfinite(x).all() and (x == np.rint(x)).all() and x.min() >= 0 and x.max() < experts):
        raise CheckpointError(f"the hash-routing table (tid2eid) holds values that are not expert indices "
                              f"0..{experts - 1} (from {x.min()} to {x.max()}): MaxText keeps it in float32, exact "
                              "for those only")
    return x.astype(np.int64) if integer else x.astype(np.float32)


def _o_lora_rank(dims: ModelDims) -> int:
    return int(dims.config["o_lora_rank"])


TRANSFORMS: dict[str, Transform] = {
    "copy": Transform(_same, lambda s, d: s, _same, lambda s: s, row_axis=0),
    "linear": Transform(lambda x, d, f: x.T, lambda s, d: (s[1], s[0]), lambda x, d, f: x.T, lambda s: (s[1], s[0]),
                        row_axis=1),
    "query": Transform(_query, _per_head_shape, _query_inverse, lambda s: (s[1] * s[2], s[0]), moments="key",
                       moment_factor=_moment_factor, scale=_query_factor, row_axis=1, row_unit=_head_rows),
    "key": Transform(_key, _per_head_shape, _key_inverse, lambda s: (s[1] * s[2], s[0]), row_axis=1,
                     row_unit=_head_rows),
    "value": Transform(_value, _per_head_shape, _value_inverse, lambda s: (s[1] * s[2], s[0]), row_axis=1,
                       row_unit=_head_rows),
    "query_bias": dataclasses.replace(_as_bias(_query, _query_inverse), moments="key_bias",
                                      moment_factor=_moment_factor, scale=_query_factor),
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
    # DeepSeek-V3.2's indexer query: [index_n_heads*X, q_lora] -> [q_lora, index_n_heads, X] (its own head count).
    "indexer_head_rows": Transform(lambda x, d, f: x.T.reshape(x.shape[1], _indexer_heads(d), -1),
                                   lambda s, d: (s[1], _indexer_heads(d), s[0] // _indexer_heads(d)),
                                   lambda x, d, f: x.reshape(x.shape[0], -1).T, lambda s: (s[1] * s[2], s[0])),
    "head_columns": Transform(lambda x, d, f: x.T.reshape(d.num_heads, -1, x.shape[0]),
                              lambda s, d: (d.num_heads, s[1] // d.num_heads, s[0]),
                              lambda x, d, f: x.reshape(-1, x.shape[-1]).T, lambda s: (s[2], s[0] * s[1]),
                              row_axis=2),
    # Gemma 4's global layers, whose heads are wider than the config's head_dim: q/k/v [heads*G, H] -> [H, heads, G]
    # and the output [H, heads*G] -> [heads, G, H] (G: the global head size; no query scale, rotate-half RoPE).
    "global_heads": Transform(lambda x, d, f: x.T.reshape(x.shape[1], -1, _global_head_dim(d)),
                              lambda s, d: (s[1], s[0] // _global_head_dim(d), _global_head_dim(d)),
                              lambda x, d, f: _heads_out(x), lambda s: (s[1] * s[2], s[0]), row_axis=1,
                              row_unit=lambda s, d: _global_head_dim(d)),
    "global_out": Transform(lambda x, d, f: x.T.reshape(-1, _global_head_dim(d), x.shape[0]),
                            lambda s, d: (s[1] // _global_head_dim(d), _global_head_dim(d), s[0]),
                            lambda x, d, f: x.reshape(-1, x.shape[-1]).T, lambda s: (s[2], s[0] * s[1]),
                            row_axis=2),
    # gemma3: MaxText stores RMSNorm scales as 1 + w and the embedding pre-multiplied by sqrt(hidden).
    "norm_plus_one": Transform(lambda x, d, f: x + np.float32(1.0), lambda s, d: s,
                               lambda x, d, f: x - np.float32(1.0), lambda s: s, moments="copy", row_axis=0),
    "embed_scaled": Transform(lambda x, d, f: x * _embed_scale(d), lambda s, d: s,
                              lambda x, d, f: x / _embed_scale(d), lambda s: s, moments="copy",
                              moment_factor=_embed_moment_factor, scale=lambda d, f: _embed_scale(d), row_axis=0),
    # transformers' fused experts [E, 2I, H] (gate rows, then up rows) and [E, H, I] -> MaxText's [E, in, out].
    "expert_gate": Transform(lambda x, d, f: _expert_half(x, False), lambda s, d: (s[0], s[2], s[1] // 2),
                             lambda x, d, f: x.transpose(0, 2, 1), lambda s: (s[0], s[2], s[1]), join_axis=1,
                             row_axis=0),
    "expert_up": Transform(lambda x, d, f: _expert_half(x, True), lambda s, d: (s[0], s[2], s[1] // 2),
                           lambda x, d, f: x.transpose(0, 2, 1), lambda s: (s[0], s[2], s[1]), join_axis=1,
                           row_axis=0),
    "expert_down": Transform(lambda x, d, f: x.transpose(0, 2, 1), lambda s, d: (s[0], s[2], s[1]),
                             lambda x, d, f: x.transpose(0, 2, 1), lambda s: (s[0], s[2], s[1]), row_axis=0),
    # Llama 4: experts already [E, in, out]; the gate's columns, then the up projection's, along the last axis.
    "first_columns": Transform(lambda x, d, f: x[..., :x.shape[-1] // 2], _half_last, _same, lambda s: s,
                               join_axis=-1, row_axis=0),
    "last_columns": Transform(lambda x, d, f: x[..., x.shape[-1] // 2:], _half_last, _same, lambda s: s,
                              join_axis=-1, row_axis=0),
    # Qwen3.5's separate gated-DeltaNet projections, fused as MaxText holds them (Qwen3-Next's HF in_proj_qkvz /
    # in_proj_ba are already grouped per key head: plain "linear").
    "deltanet_qkvz": _fused_deltanet("qkvz"),
    "deltanet_ba": _fused_deltanet("ba"),
    # A depthwise convolution's kernel: torch's [channels, 1, width] -> flax's [width, 1, channels].
    "conv_kernel": Transform(lambda x, d, f: x.transpose(2, 1, 0), lambda s, d: (s[2], s[1], s[0]),
                             lambda x, d, f: x.transpose(2, 1, 0), lambda s: (s[2], s[1], s[0]), row_axis=2),
    # gpt-oss: experts already [E, in, out]; gate and up alternate along the last axis (weights and biases).
    "even_columns": Transform(lambda x, d, f: x[..., 0::2], _half_last, _same, lambda s: s, join_axis=-1,
                              interleaved=True, row_axis=0),
    "odd_columns": Transform(lambda x, d, f: x[..., 1::2], _half_last, _same, lambda s: s, join_axis=-1,
                             interleaved=True, row_axis=0),
    # DeepSeek-V4's grouped output projection: [groups * R, in] -> [groups, in, R] (R: o_lora_rank; a group's rows).
    "grouped_out": Transform(lambda x, d, f: x.reshape(-1, _o_lora_rank(d), x.shape[1]).transpose(0, 2, 1),
                             lambda s, d: (s[0] // _o_lora_rank(d), s[1], _o_lora_rank(d)),
                             lambda x, d, f: x.transpose(0, 2, 1).reshape(-1, x.shape[1]),
                             lambda s: (s[0] * s[2], s[1]), row_axis=0, row_unit=lambda s, d: _o_lora_rank(d)),
    # DeepSeek-V4's hyper-connections (see _hc_rows) and its hash-routing table.
    **{f"hc_{part}_alpha": _hc_alpha(part) for part in ("pre", "post", "res")},
    **{f"hc_{part}_beta": _hc_beta(part) for part in ("pre", "post", "res")},
    **{f"hc_{part}_scale": _hc_scale(index) for index, part in enumerate(("pre", "post", "res"))},
    "hc_norm": Transform(lambda x, d, f: np.ones(x.shape[1], np.float32), lambda s, d: (s[1], ), _unit_norm,
                         lambda s: (0, s[0]), join_axis=0, moments="hc_norm_moment"),
    "hc_norm_moment": Transform(lambda x, d, f: np.zeros(x.shape[1], np.float32), lambda s, d: (s[1], ),
                                lambda x, d, f: np.zeros((0, x.shape[0]), np.float32), lambda s: (0, s[0]),
                                join_axis=0),
    "expert_ids": Transform(lambda x, d, f: _expert_ids(x, d, False), lambda s, d: s,
                            lambda x, d, f: _expert_ids(x, d, True), lambda s: s, row_axis=0, integer=True),
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


# --------------------------------------------------------------------------- streaming (row blocks)
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
    if state != MASTER_WEIGHTS and transform.moments is not None:
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

