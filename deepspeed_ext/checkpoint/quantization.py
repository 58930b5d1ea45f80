"""Quantized weights in Hugging Face checkpoints: block-FP8 (DeepSeek-V3's release) and MXFP4 (gpt-oss's experts).

The formats, as the files and ``config.json``'s ``quantization_config`` hold them:

* **Block FP8** (``quant_method: fp8``): a linear weight ``W [.., R, C]`` is stored as ``float8_e4m3fn`` with a
  ``<name>_scale_inv`` beside it (``x.weight`` -> ``x.weight_scale_inv``) of one value per tile of
  ``weight_block_size = [bm, bn]`` rows x columns: ``W[r, c] = q[r, c] * scale_inv[r // bm, c // bn]``. The grid
  is ``ceil(R / bm) x ceil(C / bn)``: the last tile of a row or column may be partial (DeepSeek-V3's 576-row
  ``kv_a_proj_with_mqa`` with 128-row tiles). Scales are usually fp32; bf16, E8M0 (``float8_e8m0fnu``) and E8M0
  bytes in ``uint8`` (``2 ** (byte - 127)``) are read too. Without ``weight_block_size``, one scale covers the
  tensor.
* **MXFP4** (``quant_method: mxfp4``): a weight ``W [.., K, N]`` (gpt-oss's ``gate_up_proj`` / ``down_proj``, of
  shape ``[E, in, out]``) is stored transposed, in blocks of 32 values along ``K``: ``<name>_blocks [.., N, K/32,
  16]`` (uint8, two E2M1 values a byte, the low nibble first) and ``<name>_scales [.., N, K/32]`` (E8M0 bytes,
  bias 127). ``W[.., k, n] = e2m1(nibble) * 2 ** (scale - 127)``.
* **FP4 in an FP8 checkpoint** (DeepSeek-V4's experts, ``expert_dtype: fp4``): a weight ``W [.., R, C]`` stored
  ``int8`` ``[.., R, C/2]``, two E2M1 values a byte (the low nibble first), with block scales beside it as FP8
  weights have them (DeepSeek-V4: E8M0, one per 32 values of a row); the tile is the weight's shape over the
  scales' grid, as transformers derives it. DeepSeek-V4's release names an FP8 weight's scales ``x.scale`` (for
  ``x.weight``), which is read as ``x.weight_scale_inv`` is.

Dequantization is computed as transformers computes it (``q.float() * scale.float()`` elementwise for FP8; the
E2M1 value times a power of two for MXFP4), so the fp32 values are bit-equal to transformers' and a narrower
dtype is the same cast of them. It reads a range of rows at a time: memory follows the rows asked for, not the
tensor. Quantization (``to-hf --quantize``) recomputes scales so that quantizing the dequantized weights of a
checkpoint gives its bytes back: FP8 takes transformers' rule (``scale = 448 / amax`` per tile, ``scale_inv =
1 / scale``) and, where the weights are exactly some ``q * s`` (unchanged since they were dequantized), the
``s`` that reproduces every value; MXFP4 takes the OCP MX rule (shared exponent ``floor(log2 amax) - 2``, E2M1
rounded to nearest even), under which a block that is already exactly representable keeps its values.
DeepSeek-V4's format (FP8 and FP4 with power-of-two scales) is written by :func:`quantize_pow2`: DeepSeek's rule,
and where a release's own scale holds a tile exactly, that scale.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from deepspeed_ext.checkpoint.float_bits import E8M0_BIAS as E8M0_BIAS  # re-exported: readers take them from here
from deepspeed_ext.checkpoint.float_bits import MX_BLOCK as MX_BLOCK
from deepspeed_ext.checkpoint.float_bits import (E2M1_AS_HALF_EXPONENT, E4M3_AS_HALF_FACTOR, e2m1_as_half,
                                                  e4m3_as_float32, folds, mxfp4_packed_rows, mxfp4_rows)
from deepspeed_ext.errors import CheckpointError

FP8 = "fp8"
MXFP4 = "mxfp4"
METHODS = (FP8, MXFP4)
#: A :class:`QuantizedTensor`'s method for packed E2M1 weights with block scales in an FP8 checkpoint.
FP4 = "fp4"
#: DeepSeek-V4's release: ``x.scale`` holds the block scales of ``x.weight``.
RELEASE_SCALE_SUFFIX = ".scale"
#: ``quantization_config`` key and the config entries transformers' quantizers read.
CONFIG_KEY = "quantization_config"
FP8_SCALE_SUFFIX = "_scale_inv"
MX_BLOCKS_SUFFIX = "_blocks"
MX_SCALES_SUFFIX = "_scales"
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
#: E2M1 values by nibble: bit 3 the sign, then two exponent bits and one mantissa bit.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: Tensors a static-activation FP8 checkpoint keeps beside the weights; not model parameters.
ACTIVATION_SCALE_SUFFIXES = (".activation_scale", ".input_scale")
#: Default FP8 tile (DeepSeek-V3's release).
DEFAULT_FP8_BLOCK = (128, 128)
#: gpt-oss's release: what its ``quantization_config`` leaves unquantized (all but the experts).
GPT_OSS_NOT_CONVERTED = ("model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head")

#: safetensors' codes of the dtypes quantized weights are stored in.
STORAGE_CODES = {torch.float8_e4m3fn: "F8_E4M3", torch.uint8: "U8", torch.float8_e8m0fnu: "F8_E8M0",
                 torch.int8: "I8"}

#: (shape, safetensors dtype code) of a tensor in the files.
Header = tuple[tuple[int, ...], str]
#: Reads a slice of a tensor in the files: ``read(name, index)`` with ``index`` a tuple of ints and slices.
SliceReader = Callable[[str, tuple[Any, ...]], torch.Tensor]


@dataclass(frozen=True)
class QuantizedTensor:
    """One model tensor the files hold quantized: its packed data and its scales."""

    name: str  # the dequantized tensor's name (what a model parameter is called in the files)
    method: str  # FP8, FP4 or MXFP4
    data: str  # the file tensor of packed values
    scales: str  # the file tensor of scales
    shape: tuple[int, ...]  # dequantized
    block: tuple[int, int]  # FP8: the tile (rows, columns); MXFP4: (1, 32) along the stored rows
    dtype: torch.dtype  # what transformers dequantizes it to (the ``source`` dtype)
    per_tensor: bool = False  # FP8 without weight_block_size: one scale for the whole tensor

    @property
    def rows(self) -> int:
        """Rows of the dequantized tensor viewed as ``[rows, shape[-1]]``."""
        return math.prod(self.shape[:-1])


@dataclass(frozen=True)
class QuantizationScheme:
    """A checkpoint's ``quantization_config``, checked."""

    method: str
    block: tuple[int, int] | None  # FP8 ``weight_block_size`` (None: one scale per tensor)
    config: Mapping[str, Any]

    def describe(self) -> str:
        if self.method == FP8:
            return f"block FP8 (e4m3, tiles {'per tensor' if self.block is None else 'x'.join(map(str, self.block))})"
        return "MXFP4 (E2M1 in blocks of 32, E8M0 scales)"


def scheme_of(model_config: Mapping[str, Any], source: str) -> QuantizationScheme | None:
    """The checkpoint's quantization (None: not quantized); one line naming what is wrong with it."""
    config = model_config.get(CONFIG_KEY)
    if config is None:
        return None
    if not isinstance(config, Mapping):
        raise CheckpointError(f"{source}: {CONFIG_KEY} is not a mapping")
    method = config.get("quant_method")
    if method not in METHODS:
        raise CheckpointError(f"{source}: {CONFIG_KEY} has quant_method {method!r}, which deepspeed-ext does not "
                              f"read (it reads {', '.join(METHODS)}); dequantize it with transformers first")
    block = None
    if method == FP8:
        fmt = config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise CheckpointError(f"{source}: {CONFIG_KEY} has fmt {fmt!r}; FP8 weights are read as e4m3 only")
        raw = config.get("weight_block_size")
        if raw is not None:
            if (not isinstance(raw, (list, tuple)) or len(raw) != 2
                    or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in raw)):
                raise CheckpointError(f"{source}: {CONFIG_KEY}.weight_block_size is {raw!r}; expected two positive "
                                      "integers [rows, columns]")
            block = (int(raw[0]), int(raw[1]))
    return QuantizationScheme(method, block, dict(config))


def _scale_dtype_ok(code: str) -> bool:
    return code in ("F32", "BF16", "F16", "U8", "F8_E8M0")


def fp8_output_dtype(scale_code: str) -> torch.dtype:
    """What transformers dequantizes an FP8 weight to: the scales' dtype where it is a float of 2+ bytes, else
    bf16."""
    return {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}.get(scale_code, torch.bfloat16)


def pair_tensors(scheme: QuantizationScheme, headers: Mapping[str, Header], where: Callable[[str], str]
                 ) -> dict[str, QuantizedTensor]:
    """The quantized tensors among ``headers`` (file tensor -> shape and dtype code), each checked against its
    scales; ``where(name)`` names the file holding a tensor, for the one-line errors."""
    found: dict[str, QuantizedTensor] = {}
    if scheme.method == FP8:
        for name, (shape, code) in headers.items():
            if name.endswith(FP8_SCALE_SUFFIX):
                weight = name[:-len(FP8_SCALE_SUFFIX)]
                if weight not in headers:
                    raise CheckpointError(f"{where(name)}: scale {name!r} has no weight {weight!r} beside it")
                continue
            if code not in ("F8_E4M3", "I8") or _release_scale(name, headers):
                continue
            scales = _scales_of(name, headers)
            if scales is None:
                raise CheckpointError(f"{where(name)}: {'FP4' if code == 'I8' else 'FP8'} weight {name!r} has no "
                                      f"scale tensor {name + FP8_SCALE_SUFFIX!r}")
            found[name] = (_fp4_tensor(name, shape, scales, headers[scales], where) if code == "I8" else
                           _fp8_tensor(scheme, name, shape, scales, headers[scales], where))
    else:
        for name, (shape, code) in headers.items():
            if name.endswith(MX_SCALES_SUFFIX):
                stem = name[:-len(MX_SCALES_SUFFIX)]
                if stem + MX_BLOCKS_SUFFIX not in headers and code == "U8":
                    raise CheckpointError(f"{where(name)}: MXFP4 scales {name!r} have no blocks "
                                          f"{stem + MX_BLOCKS_SUFFIX!r} beside them")
                continue
            if not name.endswith(MX_BLOCKS_SUFFIX):
                continue
            stem = name[:-len(MX_BLOCKS_SUFFIX)]
            scales = stem + MX_SCALES_SUFFIX
            if scales not in headers:
                raise CheckpointError(f"{where(name)}: MXFP4 blocks {name!r} have no scales {scales!r}")
            found[stem] = _mxfp4_tensor(stem, name, shape, code, scales, headers[scales], where)
    return found


def _release_scale(name: str, headers: Mapping[str, Header]) -> bool:
    """Whether ``name`` is the scales of a quantized ``x.weight`` under the release's ``x.scale``."""
    if not name.endswith(RELEASE_SCALE_SUFFIX):
        return False
    weight = headers.get(name[:-len(RELEASE_SCALE_SUFFIX)] + ".weight")
    return weight is not None and weight[1] in ("F8_E4M3", "I8")


def _scales_of(name: str, headers: Mapping[str, Header]) -> str | None:
    """The scale tensor of quantized weight ``name``: ``<name>_scale_inv``, or the release's ``x.scale``."""
    if name + FP8_SCALE_SUFFIX in headers:
        return name + FP8_SCALE_SUFFIX
    release = name[:-len(".weight")] + RELEASE_SCALE_SUFFIX if name.endswith(".weight") else None
    return release if release in headers else None


def _fp4_tensor(name: str, shape: tuple[int, ...], scales: str, scale_header: Header,
                where: Callable[[str], str]) -> QuantizedTensor:
    """Packed E2M1 ``[.., R, C/2]`` (int8) with block scales ``[.., R / bm, C / bn]``: the tile is the weight's
    shape over the scales' grid."""
    scale_shape, scale_code = scale_header
    if not _scale_dtype_ok(scale_code):
        raise CheckpointError(f"{where(scales)}: FP4 scale {scales!r} has dtype {scale_code}; expected F32, BF16, "
                              "F16, F8_E8M0 or U8 (E8M0 bytes)")
    full = (*shape[:-1], 2 * shape[-1]) if len(shape) >= 2 else tuple(shape)
    grid = tuple(scale_shape)
    if (len(full) < 2 or len(grid) != len(full) or grid[:-2] != full[:-2] or not all(grid[-2:])
            or full[-2] % grid[-2] or full[-1] % grid[-1]):
        raise CheckpointError(f"{where(scales)}: {scales!r} has shape {list(scale_shape)}, which is no grid of "
                              f"whole tiles over FP4 weight {name!r} of {list(full)} values (stored {list(shape)})")
    block = (full[-2] // grid[-2], full[-1] // grid[-1])
    return QuantizedTensor(name, FP4, name, scales, full, block, fp8_output_dtype(scale_code))


def _fp8_tensor(scheme: QuantizationScheme, name: str, shape: tuple[int, ...], scales: str, scale_header: Header,
                where: Callable[[str], str]) -> QuantizedTensor:
    scale_shape, scale_code = scale_header
    if not _scale_dtype_ok(scale_code):
        raise CheckpointError(f"{where(scales)}: FP8 scale {scales!r} has dtype {scale_code}; expected F32, BF16, "
                              "F16, F8_E8M0 or U8 (E8M0 bytes)")
    if len(shape) < 2:
        raise CheckpointError(f"{where(name)}: FP8 weight {name!r} has shape {list(shape)}; block scales need 2+ "
                              "dimensions")
    rows, cols = shape[-2:]
    if scheme.block is None:
        if math.prod(scale_shape) != 1:
            raise CheckpointError(f"{where(scales)}: {scales!r} has shape {list(scale_shape)}, but the config sets no "
                                  "weight_block_size, which means one scale per tensor")
        return QuantizedTensor(name, FP8, name, scales, tuple(shape), (rows, cols), fp8_output_dtype(scale_code),
                               per_tensor=True)
    bm, bn = scheme.block
    grid = (*shape[:-2], -(-rows // bm), -(-cols // bn))
    if tuple(scale_shape) != grid:
        raise CheckpointError(f"{where(scales)}: {scales!r} has shape {list(scale_shape)}, but weight {name!r} of "
                              f"shape {list(shape)} in tiles of {bm}x{bn} needs a grid of {list(grid)}")
    return QuantizedTensor(name, FP8, name, scales, tuple(shape), (bm, bn), fp8_output_dtype(scale_code))


def _mxfp4_tensor(stem: str, blocks: str, shape: tuple[int, ...], code: str, scales: str, scale_header: Header,
                  where: Callable[[str], str]) -> QuantizedTensor:
    scale_shape, scale_code = scale_header
    if code != "U8" or len(shape) < 3 or shape[-1] != MX_BLOCK // 2:
        raise CheckpointError(f"{where(blocks)}: MXFP4 blocks {blocks!r} are {code} of shape {list(shape)}; expected "
                              f"U8 of shape [..., rows, blocks, {MX_BLOCK // 2}]")
    if scale_code != "U8" or tuple(scale_shape) != tuple(shape[:-1]):
        raise CheckpointError(f"{where(scales)}: MXFP4 scales {scales!r} are {scale_code} of shape "
                              f"{list(scale_shape)}; blocks {blocks!r} of shape {list(shape)} need U8 of shape "
                              f"{list(shape[:-1])}")
    *lead, out_rows, groups, _ = shape
    # Stored transposed: the model tensor is [..., groups * 32, out_rows].
    return QuantizedTensor(stem, MXFP4, blocks, scales, (*lead, groups * MX_BLOCK, out_rows), (1, MX_BLOCK),
                           torch.bfloat16)


# --------------------------------------------------------------------------- dequantization
def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 exponents (uint8 bytes or ``float8_e8m0fnu``) as fp32 powers of two."""
    if scales.dtype == torch.uint8:
        return (scales.to(torch.float32) - E8M0_BIAS).exp2()
    return scales.to(torch.float32)


def dequantize_rows(tensor: QuantizedTensor, read: SliceReader, first: int, last: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """Rows ``[first, last)`` of the dequantized tensor viewed as ``[rows, shape[-1]]``, in ``dtype``, reading only
    the packed values and scales that hold them."""
    parts = []
    per_lead = tensor.shape[-2]
    row = first
    while row < last:
        lead, local = divmod(row, per_lead)
        stop = min(last, (lead + 1) * per_lead) - lead * per_lead
        index = _lead_index(tensor.shape[:-2], lead)
        if tensor.method == FP8:
            parts.append(_fp8_rows(tensor, read, index, local, stop))
        elif tensor.method == FP4:
            parts.append(_fp4_rows(tensor, read, index, local, stop))
        else:
            parts.append(_mxfp4_rows(tensor, read, index, local, stop, dtype))
        row = lead * per_lead + stop
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out.to(dtype).contiguous()


def _lead_index(lead_shape: tuple[int, ...], lead: int) -> tuple[int, ...]:
    index = []
    for size in reversed(lead_shape):
        lead, at = divmod(lead, size)
        index.append(at)
    return tuple(reversed(index))


def _fp8_rows(tensor: QuantizedTensor, read: SliceReader, index: tuple[int, ...], first: int,
              stop: int) -> torch.Tensor:
    bm = tensor.block[0]
    q = read(tensor.data, (*index, slice(first, stop)))
    grid_first, grid_stop = first // bm, -(-stop // bm)
    if tensor.per_tensor:  # one scale (a scalar or [1, 1] in the files)
        scales = read(tensor.scales, ()).reshape(1, 1)
    else:
        scales = read(tensor.scales, (*index, slice(grid_first, grid_stop)))
    return fp8_dequantize(q, scales, tensor.block, first - grid_first * bm)


def _fp4_rows(tensor: QuantizedTensor, read: SliceReader, index: tuple[int, ...], first: int,
              stop: int) -> torch.Tensor:
    """Rows ``[first, stop)`` of a packed E2M1 weight: its bytes unpacked, times their tiles' scales."""
    bm = tensor.block[0]
    packed = read(tensor.data, (*index, slice(first, stop)))
    grid_first, grid_stop = first // bm, -(-stop // bm)
    scales = read(tensor.scales, (*index, slice(grid_first, grid_stop)))
    return fp8_dequantize(unpack_e2m1(packed.view(torch.uint8)), scales, tensor.block, first - grid_first * bm)


def _mxfp4_rows(tensor: QuantizedTensor, read: SliceReader, index: tuple[int, ...], first: int,
                stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``[first, stop)`` of the model tensor are columns of the stored one: the groups that hold them, from
    the stored matrix (an expert's) read and transposed whole once a thread and kept while the rows asked for are
    in it."""
    group_first, group_stop = first // MX_BLOCK, -(-stop // MX_BLOCK)
    packed_rows, scales = _stored_matrix(tensor, read, index)  # [groups * 16, out], [groups, out]
    values = mxfp4_rows(packed_rows[group_first * MX_BLOCK // 2:group_stop * MX_BLOCK // 2],
                        scales[group_first:group_stop], dtype)
    return values[first - group_first * MX_BLOCK:stop - group_first * MX_BLOCK]


_last_matrix = threading.local()


def _stored_matrix(tensor: QuantizedTensor, read: SliceReader, index: tuple[int, ...]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed blocks and scales of one stored matrix (``index``: an expert), transposed into the model's row
    order (:func:`~deepspeed_ext.checkpoint.float_bits.mxfp4_packed_rows`), kept for this thread's next call. A
    block of model rows is a few groups of every stored row, bytes strided over the whole matrix: read alone,
    each block touched (and safetensors mapped) the matrix's every page, a 265 MB expert stack at once in RSS; kept
    transposed, each block's rows are contiguous bytes. An expert is a few MiB (gpt-oss: 8 MiB, the largest)."""
    key = (read, tensor.data, tensor.scales, index)
    kept = getattr(_last_matrix, "kept", None)
    if kept is None or kept[0] != key:
        kept = _last_matrix.kept = (key, *mxfp4_packed_rows(read(tensor.data, index), read(tensor.scales, index)))
    return kept[1], kept[2]


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
                     ) -> torch.Tensor:
    """Stored ``blocks [out, groups, 16]`` and ``scales [out, groups]`` -> the model's ``[groups * 32, out]``,
    contiguous, in ``dtype``: each E2M1 value times ``2 ** (scale - 127)``, one rounding, as transformers computes
    it (:func:`~deepspeed_ext.checkpoint.float_bits.mxfp4_rows`)."""
    return mxfp4_rows(*mxfp4_packed_rows(blocks, scales), dtype)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Two E2M1 values a byte, the low nibble first, as fp32 ``[..., 2 * bytes]`` (through
    :func:`~deepspeed_ext.checkpoint.float_bits.e2m1_as_half`, its factor taken back: exact)."""
    halves = e2m1_as_half(packed.to(torch.uint8))
    return halves.to(torch.float32).mul_(2.0 ** E2M1_AS_HALF_EXPONENT)


# --------------------------------------------------------------------------- quantization
def fp8_quantizable(shape: tuple[int, ...], block: tuple[int, int]) -> bool:
    """Whether a weight is whole tiles (transformers quantizes only those; the others stay unquantized)."""
    return len(shape) >= 2 and shape[-2] % block[0] == 0 and shape[-1] % block[1] == 0



def _tiles(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` in fp32 as a grid of ``block`` tiles ``[grid_rows, bm, grid_cols, bn]`` (edge tiles padded with
    zeros, which change no tile's largest value), and each tile's largest magnitude ``[grid_rows, grid_cols]``."""
    bm, bn = block
    rows, cols = weight.shape
    grid_rows, grid_cols = -(-rows // bm), -(-cols // bn)
    x = weight.to(torch.float32)
    if (grid_rows * bm, grid_cols * bn) != (rows, cols):
        x = torch.nn.functional.pad(x, (0, grid_cols * bn - cols, 0, grid_rows * bm - rows))
    x = x.reshape(grid_rows, bm, grid_cols, bn)
    return x, x.abs().amax(dim=(1, 3))

def quantize_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [rows, cols]`` -> (``float8_e4m3fn`` values, fp32 ``scale_inv`` per tile, a grid of
    ``ceil(rows / bm) x ceil(cols / bn)``: partial tiles at the edges, DeepSeek's way, where the weight is not
    whole tiles).

    transformers' rule: ``scale = 448 / amax`` per tile (1 for an all-zero tile), ``q = clamp(w * scale)`` cast
    to e4m3, ``scale_inv = 1 / scale``. ``scale_inv`` comes out of two roundings, so quantizing ``q * scale_inv``
    again may land an ulp or two off the original; where a tile's values are exactly ``q * s`` for an ``s`` within
    a few ulps, that ``s`` is kept, which makes dequantize -> quantize give the original bytes."""
    packed, scale_inv, _ = quantize_fp8_with_values(weight, block, values=False)
    return packed, scale_inv


def quantize_fp8_with_values(weight: torch.Tensor, block: tuple[int, int], values: bool = True
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`quantize_fp8`, and the values a reader dequantizes from what it returns (``[rows, cols]`` fp32,
    :func:`fp8_dequantize`'s), made from the FP8 values already widened for the scale search rather than widened
    again: a writer that fingerprints what it writes needs both (``values=False``: None in their place)."""
    bm, bn = block
    x, amax = _tiles(weight, block)
    (rows, cols), (grid_rows, grid_cols) = weight.shape, amax.shape
    scale = torch.where(amax > 0, FP8_MAX / torch.where(amax > 0, amax, torch.ones_like(amax)),
                        torch.ones_like(amax))
    scale_inv = (1.0 / scale).to(torch.float32)
    q = (x * scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    qf = e4m3_as_float32(q)
    best = _exact_scales(x, amax, qf, scale_inv)
    packed = q.reshape(grid_rows * bm, grid_cols * bn)[:rows, :cols].contiguous()
    if not values:
        return packed, best, None
    # qf x best is one rounding of each value times its tile's scale: fp8_dequantize's values, bit for bit.
    return packed, best, qf.mul_(best[:, None, :, None]).reshape(grid_rows * bm, grid_cols * bn)[:rows, :cols]


#: The scales tried around ``1 / scale``, in ulps, nearest first.
_EXACT_STEPS = (0, 1, -1, 2, -2, 3, -3, 4, -4)


def _exact_scales(x: torch.Tensor, amax: torch.Tensor, qf: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """Per tile, the first scale of :data:`_EXACT_STEPS` ulps from ``scale_inv`` whose products with the tile's FP8
    values ``qf`` are exactly its values ``x`` (``[grid_rows, bm, grid_cols, bn]``), else ``scale_inv``.

    A trained weight was never quantized and fails for every tile, cheaply: a tile passes only if its largest
    value is 448 x the scale (that value's FP8 is +-448, whatever the scale's rounding: an all-zero tile passes any
    scale), then if its first row matches, and only then is it compared whole."""
    settled = torch.zeros_like(amax, dtype=torch.bool)
    best = scale_inv
    zero, first_q, first_x = amax == 0, qf[:, 0], x[:, 0]
    for step in _EXACT_STEPS:
        candidate = scale_inv
        toward = torch.full_like(scale_inv, math.inf if step > 0 else 0.0)
        for _ in range(abs(step)):
            candidate = torch.nextafter(candidate, toward)
        maybe = (zero | (FP8_MAX * candidate == amax)) & ~settled
        if not bool(maybe.any()):
            continue
        maybe[maybe.clone()] = (first_q[maybe] * candidate[maybe][:, None] == first_x[maybe]).all(dim=1)
        if not bool(maybe.any()):
            continue
        hit = maybe & (qf * candidate[:, None, :, None] == x).all(dim=3).all(dim=1)
        best = torch.where(hit, candidate, best)
        settled |= hit
        if bool(settled.all()):
            break
    return best


def fp8_dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], row_offset: int = 0
                   ) -> torch.Tensor:
    """``q [rows, cols]`` (FP8 values, or E2M1 values unpacked to fp32) times its tile's scale (``scale_inv``'s rows
    start ``row_offset`` rows above ``q``'s first), elementwise in fp32 as transformers computes it: one rounding
    of each value times its scale.

    The scales are laid out once per row of ``q`` (a 1/``bn`` of its size) and multiplied a tile row at a time,
    never spread over every element; FP8 values are widened by :func:`e4m3_as_float32`."""
    rows, cols = q.shape
    bm, bn = block
    per_row = e8m0_to_float(scale_inv).repeat_interleave(bm, 0)[row_offset:row_offset + rows]  # [rows, grid_cols]
    if q.dtype == FP8_DTYPE:
        out, factor = e4m3_as_float32(q, scaled_down=True), E4M3_AS_HALF_FACTOR
        if folds(per_row, factor):
            per_row = per_row * factor  # exact: one rounding of value x scale below, as transformers'
        else:
            out.mul_(factor)  # exact (a power of two on values at most 448)
    else:
        out = q.to(torch.float32, copy=True)
    whole = cols // bn
    if whole:
        out[:, :whole * bn].view(rows, whole, bn).mul_(per_row[:, :whole, None])
    if whole * bn < cols:  # a partial tile at the right edge
        out[:, whole * bn:].mul_(per_row[:, whole:whole + 1])
    return out


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [K, N]`` (K a multiple of 32) -> MXFP4 as stored: blocks ``[N, K/32, 16]`` and scales ``[N, K/32]``.

    The OCP MX rule: per 32 values along K, the shared exponent is ``floor(log2 amax) - 2`` (E2M1's largest
    exponent), the values divided by it are rounded to the nearest E2M1 value (ties to even) and saturate at 6.
    A block that is exactly representable keeps its values (and its bytes, where its largest value is 4 or 6)."""
    k, n = weight.shape
    x = weight.to(torch.float32).t().reshape(n, k // MX_BLOCK, MX_BLOCK)
    amax = x.abs().amax(dim=-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(torch.where(amax > 0, amax, torch.ones_like(amax)))) - 2,
                           torch.full_like(amax, -E8M0_BIAS))
    exponent = exponent.clamp(-E8M0_BIAS, E8M0_BIAS)
    code = e2m1_codes(torch.ldexp(x, -exponent.to(torch.int32).unsqueeze(-1)))
    code = code.reshape(n, k // MX_BLOCK, MX_BLOCK // 2, 2)
    blocks = code[..., 0] | (code[..., 1] << 4)
    scales = (exponent + E8M0_BIAS).to(torch.uint8)
    return blocks, scales


def e2m1_codes(scaled: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by their scale) as E2M1 nibbles (uint8, bit 3 the sign): the nearest E2M1 value,
    a tie to the one whose mantissa bit is even, past 6 saturating at 6."""
    magnitude = scaled.abs().contiguous()
    magnitudes = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32)
    midpoints = (magnitudes[1:] + magnitudes[:-1]) / 2
    code = torch.searchsorted(midpoints, magnitude, right=False)  # a tie goes to the lower value ...
    tie = (code < 7) & (magnitude == midpoints[code.clamp(max=6)])
    code = torch.where(tie & (code % 2 == 1), code + 1, code)  # ... unless that one's mantissa bit is odd
    return (code | (torch.signbit(scaled).to(torch.int64) << 3)).to(torch.uint8)


# --------------------------------------------------------------------------- power-of-two scales (DeepSeek-V4)
#: A :class:`~deepspeed_ext.checkpoint.hf.quantized.QuantizedPiece`'s method for FP8 with E8M0 scales
#: (DeepSeek-V4's release); its FP4 experts are :data:`FP4`.
FP8_POW2 = "fp8_ue8m0"
FP4_MAX = 6.0  # E2M1's largest magnitude
#: The exponents the quantizer picks: E8M0 holds -127..127 (byte 255 is NaN); the smallest is transformers'
#: (its quantizer floors the scale at fp32's smallest normal), which keeps every bf16 tile's scale equal to its.
POW2_EXPONENTS = (-126, 127)
#: safetensors' codes of E8M0 scales: ``float8_e8m0fnu``, or its bytes as ``uint8``.
E8M0_CODES = ("F8_E8M0", "U8")
STORAGE_DTYPES = {code: dtype for dtype, code in STORAGE_CODES.items()}


def quantize_pow2(weight: torch.Tensor, element: str, block: tuple[int, int],
                  reference: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [rows, cols]`` with one power-of-two scale per tile of ``block`` (partial at the edges), as
    DeepSeek-V4's release stores its weights -> (the values, ``[rows, cols]``: ``float8_e4m3fn`` for ``element``
    :data:`FP8`, E2M1 nibbles as uint8 for :data:`FP4`; the scales as E8M0 bytes, ``[ceil(rows / bm),
    ceil(cols / bn)]``).

    DeepSeek's rule, in fp32 as its kernels compute it: ``scale = 2 ** ceil(log2(amax * (1 / max)))`` with ``max``
    448 (e4m3) or 6 (e2m1); the values divided by it are rounded to the nearest (ties to even) and saturate. For
    bf16 weights this is the scale transformers' ``ue8m0`` quantizer picks. An all-zero tile gets scale 1, as
    transformers gives it.

    The values do not always say which scale a release used: a tile whose largest value was rounded down to half
    the range (224 x 2^e in FP8, 3 x 2^e in FP4) reads back as the same values at half the scale, which the rule
    picks. ``reference`` (E8M0 bytes of the same grid: the release's scales) is taken for every tile it represents
    exactly, which gives an unchanged tile its bytes back. That never changes a value: a scale that represents a
    tile exactly is at least the rule's, and the rule's then represents it exactly too."""
    maximum = FP8_MAX if element == FP8 else FP4_MAX
    bm, bn = block
    x, amax = _tiles(weight, block)
    (rows, cols), (grid_rows, grid_cols) = weight.shape, amax.shape
    mantissa, exponent = torch.frexp(amax * torch.tensor(1 / maximum, dtype=torch.float32))
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)  # ceil(log2): a power of two is its own
    exponent = torch.where(amax > 0, exponent.clamp(*POW2_EXPONENTS), torch.zeros_like(exponent))
    if reference is not None:
        if tuple(reference.shape) != (grid_rows, grid_cols):
            raise CheckpointError(f"reference scales of shape {list(reference.shape)} for a grid of "
                                  f"{[grid_rows, grid_cols]}")
        candidate = reference.view(torch.uint8).to(torch.int32) - E8M0_BIAS
        scaled = torch.ldexp(x, -candidate[:, None, :, None])
        if element == FP8:
            exact = (scaled.abs() <= FP8_MAX) & (scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() == scaled)
        else:
            exact = (scaled.abs() <= FP4_MAX) & (e2m1_values(e2m1_codes(scaled)) == scaled)
        usable = exact.all(dim=3).all(dim=1) & (reference.view(torch.uint8) != 255)  # 255: E8M0's NaN
        exponent = torch.where(usable, candidate, exponent)
    scaled = torch.ldexp(x, -exponent[:, None, :, None])
    values = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE) if element == FP8 else e2m1_codes(scaled)
    values = values.reshape(grid_rows * bm, grid_cols * bn)[:rows, :cols].contiguous()
    return values, (exponent + E8M0_BIAS).to(torch.uint8)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 nibbles (uint8) as fp32 values."""
    return torch.tensor(E2M1_VALUES, dtype=torch.float32)[codes.long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 nibbles ``[..., 2n]`` two a byte, the low nibble first: uint8 ``[..., n]``."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)
