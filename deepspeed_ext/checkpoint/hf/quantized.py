"""Weights written quantized as releases store them (`--quantize fp8` / `mxfp4`): which tensors, their scales, and
the writes of both."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepspeed_ext.checkpoint.hf.files import TIED_PAIR, FileTensor, write_at
from deepspeed_ext.checkpoint.hf.options import HFOptions
from deepspeed_ext.checkpoint.model_config import ConfigFit
from deepspeed_ext.checkpoint.tensor import BLOCK_ELEMENTS
from deepspeed_ext.errors import CheckpointError


# --------------------------------------------------------------------------- quantized and release layouts
@dataclass(frozen=True)
class QuantizedPiece:
    """A weight written quantized: the values it is cut from (``piece``) and the two tensors stored for them."""

    piece: FileTensor  # the values (their span in the parameter; name: the dequantized tensor's)
    data: FileTensor  # packed values
    scales: FileTensor
    method: str
    block: tuple[int, int]


def stored_entries(piece: FileTensor | QuantizedPiece) -> tuple[FileTensor, ...]:
    return (piece.data, piece.scales) if isinstance(piece, QuantizedPiece) else (piece, )


def quantize_plan(options: HFOptions, model_config: Mapping[str, Any],
                   pieces: dict[str, list[FileTensor | QuantizedPiece]], shapes: Mapping[str, tuple[int, ...]],
                   label: str, fit: ConfigFit, stored_quantized: set[str]) -> dict[str, Any]:
    """Replace the pieces written quantized by :class:`QuantizedPiece`; the ``quantization_config`` to write.
    ``stored_quantized``: tensors outside the model (copied from a release) to quantize as it had them."""
    from deepspeed_ext.checkpoint import quantization as q
    if options.quantize == q.FP8:
        block = tuple(options.fp8_block)
        if len(block) != 2 or not all(isinstance(v, int) and v > 0 for v in block):
            raise CheckpointError(f"--fp8-block must be two positive integers ROWSxCOLS, not {options.fp8_block!r}")
        bm, bn = int(block[0]), int(block[1])
        from deepspeed_ext.checkpoint.model_config import linear_weights
        linear = linear_weights(fit.config())
        skipped: set[str] = set()
        for param, entries in pieces.items():
            for i, entry in enumerate(entries):
                if not isinstance(entry, FileTensor):
                    continue
                is_linear = (param in linear or param in stored_quantized
                             or (entry.expert is not None and entry.name.endswith(".weight")))
                if not is_linear or param == TIED_PAIR[0]:
                    continue
                if len(entry.shape) != 2 or not (options.fp8_edge_tiles or q.fp8_quantizable(entry.shape, (bm, bn))):
                    skipped.add(entry.name.rsplit(".", 1)[0])
                    continue
                grid = (-(-entry.shape[0] // bm), -(-entry.shape[1] // bn))
                entries[i] = QuantizedPiece(entry, FileTensor(entry.name, param, entry.shape, q.FP8_DTYPE),
                                            FileTensor(entry.name + q.FP8_SCALE_SUFFIX, param, grid, torch.float32),
                                            q.FP8, (bm, bn))
        not_converted = sorted({"lm_head", *skipped})
        written = {"quant_method": q.FP8, "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": [bm, bn], "modules_to_not_convert": not_converted}
        if model_config.get("expert_dtype") is not None:
            # DeepSeek-V4's config says its release's experts are FP4 (transformers moves a top-level expert_dtype
            # into the quantization_config); these are FP8 like every other weight written here.
            written["expert_dtype"] = q.FP8
        return written
    if options.quantize == q.MXFP4:
        if model_config.get("model_type") != "gpt_oss":
            raise CheckpointError(f"{label}: --quantize mxfp4 writes gpt-oss's experts as its release does; this is a "
                                  f"{model_config.get('model_type')!r} model (use --quantize fp8)")
        for param, entries in pieces.items():
            if not re.fullmatch(r"model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)", param):
                continue
            (entry, ) = entries
            assert isinstance(entry, FileTensor)
            *lead, k, n = shapes[param]
            if k % q.MX_BLOCK:
                raise CheckpointError(f"{param}: {k} input features are not whole MXFP4 blocks of {q.MX_BLOCK}")
            stem = entry.name
            entries[0] = QuantizedPiece(
                entry, FileTensor(stem + q.MX_BLOCKS_SUFFIX, param, (*lead, n, k // q.MX_BLOCK, q.MX_BLOCK // 2),
                                  torch.uint8),
                FileTensor(stem + q.MX_SCALES_SUFFIX, param, (*lead, n, k // q.MX_BLOCK), torch.uint8),
                q.MXFP4, (1, q.MX_BLOCK))
        return {"quant_method": q.MXFP4, "modules_to_not_convert": list(q.GPT_OSS_NOT_CONVERTED)}
    raise CheckpointError(f"--quantize must be one of {', '.join(q.METHODS)}, not {options.quantize!r}")


def write_quantized(entry: QuantizedPiece, values: torch.Tensor, at: Mapping[str, tuple[int, int, Path]], name: str,
                     sums: list[tuple[str, str, int, tuple[int, float, float]]]) -> None:
    """A weight quantized and written (on a writer thread), a block of rows at a time; its fingerprint is of the
    values a reader dequantizes, which is what the file holds."""
    from deepspeed_ext.checkpoint import quantization as q
    from deepspeed_ext.checkpoint.fingerprint import partial_sums
    data_fd, data_offset, data_path = at[entry.data.name]
    scale_fd, scale_offset, scale_path = at[entry.scales.name]
    if entry.method == q.FP8:
        bm, bn = entry.block
        rows, cols = math.prod(entry.piece.shape[:-1]), entry.piece.shape[-1]
        values = values.reshape(rows, cols)
        step = bm * max(1, BLOCK_ELEMENTS // (bm * cols))  # whole tile rows, as many as a streamed block
        for first in range(0, rows, step):
            chunk = values[first:first + step]
            packed, scales = q.quantize_fp8(chunk, (bm, bn))
            sums.append((name, data_path.name, data_offset + first * cols,
                         partial_sums(q.fp8_dequantize(packed, scales, (bm, bn)))))
            write_at(data_fd, packed.view(torch.uint8).reshape(-1).numpy().data, data_offset + first * cols,
                      data_path)
            write_at(scale_fd, scales.reshape(-1).view(torch.uint8).numpy().data,
                      scale_offset + (first // bm) * scales.shape[1] * 4, scale_path)
        return
    *lead, k, n = entry.piece.shape
    values = values.reshape(-1, k, n)
    for expert in range(values.shape[0]):
        blocks, scales = q.quantize_mxfp4(values[expert])
        offset = data_offset + expert * blocks.numel()
        sums.append((name, data_path.name, offset, partial_sums(q.mxfp4_dequantize(blocks, scales).contiguous())))
        write_at(data_fd, blocks.reshape(-1).numpy().data, offset, data_path)
        write_at(scale_fd, scales.reshape(-1).numpy().data, scale_offset + expert * scales.numel(), scale_path)
