"""Low-precision floats widened through their bits: FP8 (e4m3fn) and E2M1 (FP4) values moved into fp16's bit
layout, which widens to fp32 with vector instructions, where torch's own casts go an element at a time. Exact:
each gives the values divided by a power of two, which a caller multiplies back in with its scales
(:mod:`deepspeed_ext.checkpoint.quantization`)."""

from __future__ import annotations

import functools
import math

import torch

#: :func:`e2m1_as_half` gives each value divided by ``2 ** E2M1_AS_HALF_EXPONENT``.
E2M1_AS_HALF_EXPONENT = 14


def e2m1_as_half(packed: torch.Tensor) -> torch.Tensor:
    """Two E2M1 values a byte (the low nibble first) as fp16 ``[..., 2 * bytes]``, each divided by
    ``2 ** E2M1_AS_HALF_EXPONENT``: one lookup a byte in a table of both its values (:func:`_e2m1_pairs`), 5x faster
    here than unpacking the nibbles with integer passes, 30x faster than a lookup a value."""
    pairs = torch.index_select(_e2m1_pairs(), 0, packed.reshape(-1).view(torch.uint8).to(torch.int32))
    return pairs.view(torch.float16).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


@functools.cache
def _e2m1_pairs() -> torch.Tensor:
    """Every byte's two E2M1 values as two fp16s in one int32 (the low nibble's in the low half, which is first in
    memory). A nibble's exponent and mantissa bits are an fp16's low exponent bits and top mantissa bit (E2M1's
    subnormal 0.5 lands on fp16's), its sign fp16's; the value comes out divided by ``2 ** E2M1_AS_HALF_EXPONENT``."""
    bits = torch.arange(256, dtype=torch.int32)
    low = ((bits & 0x07) << 9) | ((bits & 0x08) << 12)
    high = ((bits & 0x70) << 5) | ((bits & 0x80) << 8)
    return low | (high << 16)


@functools.cache
def _e2m1_bfloat16_pairs() -> torch.Tensor:
    """:func:`_e2m1_pairs` as bf16 values (each an exact cast of the fp16 one times its factor), two an int32."""
    halves = _e2m1_pairs().view(torch.float16).to(torch.float32) * 2.0 ** E2M1_AS_HALF_EXPONENT
    bits = halves.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    low, high = bits[0::2], bits[1::2]
    return low | (high << 16)


#: E8M0's bias: a scale byte ``s`` is ``2 ** (s - 127)``.
E8M0_BIAS = 127
#: Values per MXFP4 group (one scale each), 16 bytes.
MX_BLOCK = 32
#: 2 ** -127 in bf16's bits: a subnormal (E8M0's 0; every other scale is an exponent field of its own, ``scale << 7``).
_BF16_TWO_TO_MINUS_127 = 0x0040


def mxfp4_rows(packed_rows: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 values in the model's layout, contiguous ``[groups * 32, out]`` in ``dtype``, from the stored blocks
    transposed: ``packed_rows [groups * 16, out]`` (byte ``i`` of a column holds its values ``2i`` and ``2i + 1``,
    the low nibble first) and ``scales [groups, out]`` (E8M0). Each value is E2M1 x ``2 ** (scale - 127)``, rounded
    once, as transformers computes it.

    One lookup a byte gives both its values in one int32 (:func:`_e2m1_pairs`); the pairs are split into the two
    rows they belong to, a row at a time contiguous. The stored matrix is transposed as bytes, by the caller, once
    (a value's transposing copy costs the same whatever its width, so bytes cost a quarter of bf16's per value and
    an eighth of fp32's). bf16 is computed in bf16 where every scale is at most ``2 ** 127``: bf16 has fp32's
    exponents, so it holds every E2M1 value and every such scale (2 ** -127 as a subnormal) exactly, and each
    product, exact or overflowing alike, is the fp32 value cast. Otherwise the values are widened through fp16
    (:func:`e2m1_as_half`), whose factor the scales take, and multiplied in fp32."""
    byte_rows, out = packed_rows.shape
    groups = scales.shape[0]
    exponent = scales.to(torch.int32) - E8M0_BIAS
    largest = int(exponent.max()) if exponent.numel() else -E8M0_BIAS
    in_bfloat16 = dtype == torch.bfloat16 and largest <= 127
    pairs = torch.index_select(_e2m1_bfloat16_pairs() if in_bfloat16 else _e2m1_pairs(), 0,
                               packed_rows.reshape(-1).view(torch.uint8).to(torch.int32))
    bits = torch.empty(2 * byte_rows, out, dtype=torch.int16)
    bits.view(byte_rows, 2, out).copy_(pairs.view(torch.int16).view(byte_rows, out, 2).transpose(1, 2))
    if in_bfloat16:
        factor = torch.where(scales == 0, _BF16_TWO_TO_MINUS_127, scales.to(torch.int16) << 7).to(torch.int16)
        values = bits.view(torch.bfloat16)
        values.view(groups, MX_BLOCK, out).mul_(factor.view(torch.bfloat16).unsqueeze(1))
        return values
    values = bits.view(torch.float16).to(torch.float32)  # each value over 2 ** E2M1_AS_HALF_EXPONENT
    if largest + E2M1_AS_HALF_EXPONENT <= 127:
        # 2 ** (exponent + the factor's) built from its bits: a normal fp32 power of two (exponent >= -127)
        power = ((exponent + (E2M1_AS_HALF_EXPONENT + 127)) << 23).view(torch.float32)
        values.view(groups, MX_BLOCK, out).mul_(power.unsqueeze(1))
    else:  # scales past 2 ** 113: the factor first (exact), then the scale
        values = torch.ldexp(values.mul_(2.0 ** E2M1_AS_HALF_EXPONENT).view(groups, MX_BLOCK, out),
                             exponent.unsqueeze(1)).view(-1, out)
    return values.to(dtype)


def mxfp4_packed_rows(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored MXFP4 ``blocks [out, groups, 16]`` and ``scales [out, groups]`` transposed as :func:`mxfp4_rows`
    takes them: ``[groups * 16, out]`` and ``[groups, out]``, contiguous."""
    out = blocks.shape[0]
    return (blocks.reshape(out, -1).t().contiguous().view(torch.uint8), scales.t().contiguous())


#: :func:`e4m3_as_float32` with ``scaled_down`` gives each value divided by this (a power of two).
E4M3_AS_HALF_FACTOR = 256.0


def e4m3_as_float32(q: torch.Tensor, scaled_down: bool = False) -> torch.Tensor:
    """``float8_e4m3fn`` values as fp32, exactly (NaN stays NaN); with ``scaled_down``, divided by
    :data:`E4M3_AS_HALF_FACTOR`, which a caller multiplies back in with its scales.

    torch widens FP8 one element at a time (0.3 G elements/s a core here); the same bits moved into an fp16 (the
    exponent is rebiased by 2 ** 8, which the factor undoes: e4m3's subnormals land on fp16's) widen with vector
    instructions, 4x faster in all. e4m3fn's NaN (exponent and mantissa all ones) lands on fp16's exponent 15 and is
    carried into fp16's NaN."""
    bits = q.view(torch.int8).to(torch.int16)  # the sign spread over the high byte
    bits <<= 7  # exponent and mantissa to fp16's places (bits 13..7); the sign bit stays at 15
    bits &= -0x8000 | 0x3F80
    bits |= (bits + 0x0080) & 0x4000  # 0x3F80 (e4m3fn's NaN) + 0x80 sets bit 14: fp16's all-ones exponent
    out = torch.empty(q.shape, dtype=torch.float32)
    out.copy_(bits.view(torch.float16))
    return out if scaled_down else out.mul_(E4M3_AS_HALF_FACTOR)


def folds(scales: torch.Tensor, factor: float) -> bool:
    """Whether every scale times ``factor`` (a power of two) is exact in fp32: no scale subnormal or overflowing."""
    magnitude = scales.abs()
    return bool(((magnitude == 0) | ((magnitude >= torch.finfo(torch.float32).tiny)
                                     & (magnitude * factor < math.inf))).all())
