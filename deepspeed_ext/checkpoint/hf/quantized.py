"""Weights written quantized as releases store them (`--quantize fp8` / `mxfp4`): which tensors, their scales, and
the writes of both."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from deepspeed_ext.checkpoint.hf.files import TIED_PAIR, FileTensor, write_at
from deepspeed_ext.checkpoint.hf.options import HFOptions
from deepspeed_ext.checkpoint.model_config import ConfigFit
from deepspeed_ext.checkpoint.tensor import BLOCK_ELEMENTS
from deepspeed_ext.errors import CheckpointError

if TYPE_CHECKING:
    from deepspeed_ext.checkpoint.hf.reader import HFCheckpoint


# --------------------------------------------------------------------------- quantized and release layouts
@dataclass(frozen=True)
class QuantizedPiece:
    """A weight written quantized: the values it is cut from (``piece``) and the two tensors stored for them."""

    piece: FileTensor  # the values (their span in the parameter; name: the dequantized tensor's)
    data: FileTensor  # packed values
    scales: FileTensor
    method: str
    block: tuple[int, int]
    #: Rows ``[first, last)`` of the release's own scales for this weight, as E8M0 bytes (power-of-two methods,
    #: writing into a release's layout): each tile keeps the release's scale where that represents it exactly.
    reference: Callable[[int, int], torch.Tensor] | None = None


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


def quantized_blocks(entry: QuantizedPiece) -> list[tuple[int, int]]:
    """The blocks a weight is read, quantized and written in, each on its own (:func:`write_quantized`), so memory
    follows a block, not the weight: rows ``[first, last)`` of the weight as ``[rows, cols]``, whole tile rows (the
    last one partial where the rows are not whole tiles), as many as a streamed block (``BLOCK_ELEMENTS``) or one;
    for MXFP4 experts ``[first, last)``, whole experts, as many as a streamed block or one (a larger expert is read
    in blocks of whole MXFP4 blocks of its rows)."""
    from deepspeed_ext.checkpoint import quantization as q
    if entry.method == q.MXFP4:
        *lead, k, n = entry.piece.shape
        count, step = math.prod(lead), max(1, BLOCK_ELEMENTS // max(1, k * n))
    else:
        bm = entry.block[0]
        count, cols = math.prod(entry.piece.shape[:-1]), entry.piece.shape[-1]
        step = bm * max(1, BLOCK_ELEMENTS // (bm * cols))
    return [(first, min(count, first + step)) for first in range(0, count, step)]


def write_quantized(entry: QuantizedPiece, read: Callable[[int, int], torch.Tensor], first: int, last: int,
                    at: Mapping[str, tuple[int, int, Path]], name: str,
                    sums: list[tuple[str, str, int, tuple[int, float, float]]]) -> None:
    """Block ``[first, last)`` of a weight (:func:`quantized_blocks`) quantized and written (on a writer thread);
    ``read(low, high)``: elements ``[low, high)`` of the weight flattened, read here so that only the blocks being
    written are in memory. Its share of the fingerprint is of the values a reader dequantizes, which is what the
    file holds. The quantizers work per tile (per MXFP4 block), so the bytes are those of the weight quantized
    whole."""
    from deepspeed_ext.checkpoint import quantization as q
    from deepspeed_ext.checkpoint.fingerprint import partial_sums
    if entry.method in (q.FP8_POW2, q.FP4):
        _write_pow2(entry, read, first, last, at, name, sums)
        return
    data_fd, data_offset, data_path = at[entry.data.name]
    scale_fd, scale_offset, scale_path = at[entry.scales.name]
    if entry.method == q.FP8:
        bm, bn = entry.block
        cols = entry.piece.shape[-1]
        weight = read(first * cols, last * cols).reshape(last - first, cols)
        packed, scales, values = q.quantize_fp8_with_values(weight, (bm, bn))
        del weight
        assert values is not None
        sums.append((name, data_path.name, data_offset + first * cols, partial_sums(values)))
        del values
        write_at(data_fd, packed.view(torch.uint8).reshape(-1).numpy().data, data_offset + first * cols, data_path)
        write_at(scale_fd, scales.reshape(-1).view(torch.uint8).numpy().data,
                 scale_offset + (first // bm) * scales.shape[1] * 4, scale_path)
        return
    *_, k, n = entry.piece.shape
    expert_bytes, expert_scales = entry.data.nbytes // math.prod(entry.data.shape[:-3]), n * (k // q.MX_BLOCK)
    if k * n > BLOCK_ELEMENTS:  # one expert larger than a block: its rows in blocks of whole MXFP4 blocks
        (expert, ) = range(first, last)
        blocks = torch.empty(n, k // q.MX_BLOCK, q.MX_BLOCK // 2, dtype=torch.uint8)
        scales = torch.empty(n, k // q.MX_BLOCK, dtype=torch.uint8)
        rows = q.MX_BLOCK * max(1, BLOCK_ELEMENTS // (q.MX_BLOCK * n))
        offset = data_offset + expert * expert_bytes
        for low in range(0, k, rows):
            high = min(k, low + rows)
            part, part_scales = q.quantize_mxfp4(read((expert * k + low) * n, (expert * k + high) * n).reshape(-1, n))
            groups = slice(low // q.MX_BLOCK, high // q.MX_BLOCK)
            blocks[:, groups], scales[:, groups] = part, part_scales
            # Keyed (for the order the sums are added in) by the part's first byte in the expert's first row.
            sums.append((name, data_path.name, offset + groups.start * q.MX_BLOCK // 2,
                         partial_sums(q.mxfp4_dequantize(part, part_scales))))
        # Its blocks of K are strided in the stored [N, K/32, 16]: the expert (an eighth of its fp32 size) is
        # put together here and written at once.
        write_at(data_fd, blocks.reshape(-1).numpy().data, offset, data_path)
        write_at(scale_fd, scales.reshape(-1).numpy().data, scale_offset + expert * expert_scales, scale_path)
        return
    values = read(first * k * n, last * k * n).reshape(-1, k, n)
    for expert in range(first, last):
        blocks, scales = q.quantize_mxfp4(values[expert - first])
        offset = data_offset + expert * expert_bytes
        sums.append((name, data_path.name, offset, partial_sums(q.mxfp4_dequantize(blocks, scales))))
        write_at(data_fd, blocks.reshape(-1).numpy().data, offset, data_path)
        write_at(scale_fd, scales.reshape(-1).numpy().data, scale_offset + expert * expert_scales, scale_path)


# --------------------------------------------------------------------------- a release's own format (DeepSeek-V4)
def release_quantize_plan(like: HFCheckpoint | None, options: HFOptions,
                          pieces: dict[str, list[FileTensor | QuantizedPiece]]) -> dict[str, Any] | None:
    """``--quantize fp8`` into the layout of a release whose scales are powers of two (DeepSeek-V4's: FP8 weights
    with E8M0 scales, FP4 experts): every tensor the release stores quantized is written as it stores it (its
    names, dtypes, tiles and scale layout), the others as they come; the ``quantization_config`` is the
    release's. None where there is no such release (``quantize_plan`` decides)."""
    from deepspeed_ext.checkpoint import quantization as q
    if (like is None or options.quantize != q.FP8 or like.quantization is None or like.quantization.method != q.FP8
            or like.quantization.block is None):  # (a scale per tensor: no release of this format has one)
        return None
    release = list(like.quantized_tensors.values())
    if not release or any(like.file_header(t.scales)[1] not in q.E8M0_CODES for t in release):
        return None
    tiles = {t.block for t in release if t.method == q.FP8}
    if tiles and tiles != {tuple(options.fp8_block)}:
        tile = "x".join(map(str, sorted(tiles)[0]))
        raise CheckpointError(f"{like.path}: the release's FP8 tiles are {tile} (its weight_block_size); "
                              f"--fp8-block {'x'.join(map(str, options.fp8_block))} would not write its format: "
                              f"pass --fp8-block {tile}")
    for param, entries in pieces.items():
        for i, entry in enumerate(entries):
            assert isinstance(entry, FileTensor)
            tensor = like.quantized_tensors.get(like.set_aside.get(entry.name, entry.name))
            if tensor is None:
                continue
            if len(tensor.shape) != 2 or tuple(entry.shape) != tensor.shape:
                raise CheckpointError(f"{like.path}: {entry.name} is {list(tensor.shape)} in the release, "
                                      f"{list(entry.shape)} written; its format is written for 2-D weights only")
            rows, cols = tensor.shape
            fp4 = tensor.method == q.FP4
            scale_shape, scale_code = like.file_header(tensor.scales)
            entries[i] = QuantizedPiece(
                entry, FileTensor(entry.name, param, (rows, cols // 2) if fp4 else (rows, cols),
                                  torch.int8 if fp4 else q.FP8_DTYPE),
                FileTensor(tensor.scales, param, tuple(scale_shape), q.STORAGE_DTYPES[scale_code]),
                q.FP4 if fp4 else q.FP8_POW2, tensor.block, _scale_rows(like, tensor.scales))
    return dict(like.raw_config[q.CONFIG_KEY])


def _scale_rows(like: HFCheckpoint, scales: str) -> Callable[[int, int], torch.Tensor]:
    return lambda first, last: like.read_file_rows(scales, first, last).view(torch.uint8)


def _write_pow2(entry: QuantizedPiece, read: Callable[[int, int], torch.Tensor], first: int, last: int,
                at: Mapping[str, tuple[int, int, Path]], name: str,
                sums: list[tuple[str, str, int, tuple[int, float, float]]]) -> None:
    """Rows ``[first, last)`` (whole tile rows) of a weight with power-of-two scales (FP8, or FP4 two values a
    byte), their scales from DeepSeek's rule or the release's (:func:`~deepspeed_ext.checkpoint.quantization.
    quantize_pow2`)."""
    from deepspeed_ext.checkpoint import quantization as q
    from deepspeed_ext.checkpoint.fingerprint import partial_sums
    data_fd, data_offset, data_path = at[entry.data.name]
    scale_fd, scale_offset, scale_path = at[entry.scales.name]
    element = q.FP4 if entry.method == q.FP4 else q.FP8
    bm, bn = entry.block
    rows, cols = entry.piece.shape
    row_bytes, grid_cols = entry.data.nbytes // rows, entry.scales.shape[-1]
    reference = None if entry.reference is None else entry.reference(first // bm, -(-last // bm))
    values = read(first * cols, last * cols).reshape(last - first, cols)
    stored, scales = q.quantize_pow2(values, element, (bm, bn), reference)
    exact = stored.float() if element == q.FP8 else q.e2m1_values(stored)
    sums.append((name, data_path.name, data_offset + first * row_bytes,
                 partial_sums(q.fp8_dequantize(exact, scales, (bm, bn)))))
    data = stored.view(torch.uint8) if element == q.FP8 else q.pack_e2m1(stored)
    write_at(data_fd, data.reshape(-1).numpy().data, data_offset + first * row_bytes, data_path)
    write_at(scale_fd, scales.reshape(-1).numpy().data, scale_offset + (first // bm) * grid_cols, scale_path)
