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


def e2m1_as_bfloat16(packed: torch.Tensor) -> torch.Tensor:
    """Two E2M1 values a byte (the low nibble first) as bf16 ``[..., 2 * bytes]``, the values themselves (bf16 holds
    every one): the same lookup as :func:`e2m1_as_half`, for a caller that wants bf16 in the end."""
    pairs = torch.index_select(_e2m1_bfloat16_pairs(), 0, packed.reshape(-1).view(torch.uint8).to(torch.int32))
    return pairs.view(torch.bfloat16).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


@functools.cache
def _e2m1_bfloat16_pairs() -> torch.Tensor:
    """:func:`_e2m1_pairs` as bf16 values (each an exact cast of the fp16 one times its factor), two an int32."""
    halves = _e2m1_pairs().view(torch.float16).to(torch.float32) * 2.0 ** E2M1_AS_HALF_EXPONENT
    bits = halves.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    low, high = bits[0::2], bits[1::2]
    return low | (high << 16)


def mxfp4_as_bfloat16(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 ``blocks [out, groups, 16]`` times ``2 ** (scales - 127)`` (``[out, groups]``, E8M0 at most 254: scales
    up to ``2 ** 127``) as bf16 ``[out, groups, 32]``. bf16 has fp32's exponents: it holds every E2M1 value and every
    such scale (2 ** -127 as a subnormal) exactly, so each product, exact in fp32 or overflowing to Inf alike, is the
    fp32 value cast: computed at half the bytes, with no fp32 pass."""
    values = e2m1_as_bfloat16(blocks)
    factor = torch.where(scales == 0, _BF16_TWO_TO_MINUS_127, scales.to(torch.int16) << 7).to(torch.int16)
    return values.mul_(factor.view(torch.bfloat16).unsqueeze(-1))


#: 2 ** -127 in bf16's bits: a subnormal (E8M0's 0; every other scale is an exponent field of its own, ``scale << 7``).
_BF16_TWO_TO_MINUS_127 = 0x0040


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
