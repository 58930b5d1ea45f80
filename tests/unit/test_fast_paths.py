"""The fast paths of the conversions give exactly what the plain ones give: FP8 and MXFP4 widened through fp16,
safetensors read with one pread, tensors cut into blocks inside an expert, writer threads of one torch thread."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from deepspeed_ext.checkpoint import quantization as q
from deepspeed_ext.checkpoint import serialization
from deepspeed_ext.checkpoint.hf.files import read_stored_part, read_stored_range, stored_spans
from deepspeed_ext.errors import CheckpointError


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element for element, NaN where the other has NaN, and the same sign of every zero."""
    return (a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan())
            and torch.equal(a.nan_to_num(0.5), b.nan_to_num(0.5)) and torch.equal(a.signbit(), b.signbit()))


def test_every_e4m3_byte_widens_as_torch_casts_it():
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert _same(q.e4m3_as_float32(every), every.to(torch.float32))
    assert int(q.e4m3_as_float32(every).isnan().sum()) == 2  # 0x7f and 0xff


def _fp8_reference(values: torch.Tensor, scales: torch.Tensor, block: tuple[int, int], offset: int) -> torch.Tensor:
    """transformers' rule: every value times its tile's scale, the scales spread over every element."""
    rows, cols = values.shape
    spread = scales.float().repeat_interleave(block[0], 0)[offset:offset + rows]
    return values.to(torch.float32) * spread.repeat_interleave(block[1], 1)[:, :cols]


@pytest.mark.parametrize("rows, cols, offset, block", [(256, 512, 0, (128, 128)), (300, 1000, 5, (128, 128)),
                                                        (7, 130, 127, (128, 128)), (64, 96, 3, (16, 32)),
                                                        (5, 3, 0, (1, 1))])
@pytest.mark.parametrize("scale", ["normal", "huge", "subnormal", "zero"])
def test_fp8_dequantized_as_transformers_computes_it(rows, cols, offset, block, scale):
    generator = torch.Generator().manual_seed(rows * cols + offset)
    values = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=generator).view(torch.float8_e4m3fn)
    grid = (-(-(rows + offset) // block[0]), -(-cols // block[1]))
    scales = {"normal": torch.rand(grid, generator=generator) * 1e-3, "huge": torch.rand(grid) * 1e38 + 1e37,
              "subnormal": torch.full(grid, 1e-40), "zero": torch.zeros(grid)}[scale]
    assert _same(q.fp8_dequantize(values, scales, block, offset), _fp8_reference(values, scales, block, offset))


def test_fp8_dequantize_leaves_its_input_alone():
    values = torch.rand(4, 8) * 6  # FP4 weights arrive unpacked to fp32
    before = values.clone()
    q.fp8_dequantize(values, torch.full((1, 1), 2.0), (4, 8))
    assert torch.equal(values, before)


def _mxfp4_reference(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """transformers' rule: a table of E2M1 values, times 2 ** (scale - 127) by ldexp."""
    table = torch.tensor(q.E2M1_VALUES, dtype=torch.float32)
    pairs = torch.stack((table[(blocks & 0xF).long()], table[(blocks >> 4).long()]), dim=-1)
    values = torch.ldexp(pairs.reshape(*blocks.shape[:-1], -1), (scales.to(torch.int32) - 127).unsqueeze(-1))
    return values.reshape(values.shape[0], -1).t()


def test_mxfp4_dequantized_as_transformers_computes_it_for_every_byte_and_exponent():
    # every byte in every block row, every exponent 0..255 (255: E8M0's NaN) on some row
    blocks = torch.arange(256, dtype=torch.uint8).repeat(256 * 2).reshape(256, 2, 16, 16)[:, :, 0, :].contiguous()
    blocks = torch.cat([blocks, blocks.roll(1, 0)], dim=1)  # [256, 4, 16]
    scales = torch.arange(256, dtype=torch.int32).to(torch.uint8).unsqueeze(1).repeat(1, 4)
    assert _same(q.mxfp4_dequantize(blocks, scales), _mxfp4_reference(blocks, scales))
    # in bf16 (computed in bf16 up to E8M0 254, 2 ** 127; through fp32 past it): the fp32 values cast
    assert _same(q.mxfp4_dequantize(blocks, scales, torch.bfloat16), _mxfp4_reference(blocks, scales).bfloat16())
    below = scales.clamp(max=254)
    assert _same(q.mxfp4_dequantize(blocks, below, torch.bfloat16), _mxfp4_reference(blocks, below).bfloat16())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("first, last", [(0, 96), (5, 91), (40, 41), (31, 33), (0, 1)])
def test_mxfp4_rows_in_any_range_are_the_whole_tensors_rows(dtype, first, last):
    """Rows of an MXFP4 weight 600 columns wide, cut inside its 32-row groups or on them, in the weight's dtype and in fp32: the rows of the whole tensor dequantized."""
    generator = torch.Generator().manual_seed(first * 100 + last)
    out, groups = 600, 3  # stored [out, groups, 16] -> the model's [96, 600]
    blocks = torch.randint(0, 256, (out, groups, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(110, 135, (out, groups), dtype=torch.uint8, generator=generator)
    stored = {"w_blocks": blocks, "w_scales": scales}
    tensor = q.QuantizedTensor("w", q.MXFP4, "w_blocks", "w_scales", (groups * 32, out), (1, 32), torch.bfloat16)
    rows = q.dequantize_rows(tensor, lambda name, index: stored[name][index], first, last, dtype)
    assert rows.is_contiguous()
    assert _same(rows, _mxfp4_reference(blocks, scales)[first:last].to(dtype))


@pytest.mark.parametrize("rows, cols, block", [(256, 384, (128, 128)), (300, 200, (128, 128)), (33, 70, (16, 32))])
def test_quantized_fp8_values_are_what_dequantizing_gives(rows, cols, block):
    """The values the quantizer hands a writer for its fingerprint are those its bytes dequantize to, bit for bit:
    trained weights, weights that were FP8 before (their scales found again), zero tiles, NaN and Inf."""
    generator = torch.Generator().manual_seed(rows + cols)
    trained = torch.randn(rows, cols, generator=generator) * 0.02
    before = q.fp8_dequantize(*q.quantize_fp8(trained, block), block)
    special = trained.clone()
    special[:block[0], :block[1]] = 0
    special[-1, -1], special[0, -1] = float("nan"), float("inf")
    for weight in (trained, before, special, trained * 1e-39):
        packed, scales, values = q.quantize_fp8_with_values(weight, block)
        assert values is not None
        assert torch.equal(packed.view(torch.uint8), q.quantize_fp8(weight, block)[0].view(torch.uint8))
        assert _same(values.contiguous(), q.fp8_dequantize(packed, scales, block))
    # a weight that was FP8 before comes back to its bytes
    assert torch.equal(q.fp8_dequantize(*q.quantize_fp8(before, block), block), before)


def test_e2m1_through_fp16_is_each_value_over_its_factor():
    every = torch.arange(256, dtype=torch.uint8).unsqueeze(0)
    table = torch.tensor(q.E2M1_VALUES, dtype=torch.float32)  # the values by code, low nibble first
    expected = torch.stack((table[(every & 0xF).long()], table[(every >> 4).long()]), dim=-1).reshape(1, 512)
    halves = q.e2m1_as_half(every).to(torch.float32) * 2.0 ** q.E2M1_AS_HALF_EXPONENT
    assert _same(halves, expected)
    assert _same(q.unpack_e2m1(every), expected)
    assert _same(q.unpack_e2m1(every.view(torch.int8)), expected)


@pytest.fixture
def stored(tmp_path: Path) -> Path:
    generator = torch.Generator().manual_seed(0)
    tensors = {"bf16": torch.randn(6, 5, 7, generator=generator).bfloat16(),
               "fp32": torch.randn(9, 4, generator=generator),
               "fp8": torch.randint(0, 126, (8, 16), dtype=torch.uint8, generator=generator).view(torch.float8_e4m3fn),
               "u8": torch.randint(0, 255, (3, 4, 2, 16), dtype=torch.uint8, generator=generator),
               "i64": torch.arange(10), "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    return path


@pytest.mark.parametrize("name, index", [
    ("bf16", ()), ("bf16", (slice(1, 4), )), ("bf16", (2, )), ("bf16", (2, slice(1, 3))), ("bf16", (-1, slice(None))),
    ("bf16", (5, 4)), ("fp32", (slice(7, 20), )), ("fp32", (slice(3, 3), )), ("fp8", (slice(2, 6), )),
    ("u8", (1, )), ("u8", (2, slice(1, 3))), ("i64", (slice(4, 9), )), ("scalar", ()), ("empty", ())])
def test_a_pread_reads_what_safetensors_reads(stored, name, index):
    span = stored_spans(stored)[name]
    with safe_open(str(stored), framework="pt") as handle:
        expected = handle.get_slice(name)[index] if index else handle.get_tensor(name)
    ours = read_stored_part(stored, span, index)
    assert ours is not None and ours.dtype == expected.dtype and torch.equal(ours, expected)


def test_strided_parts_go_through_safetensors_and_ranges_read_flat(stored):
    spans = stored_spans(stored)
    assert read_stored_part(stored, spans["u8"], (1, slice(None), slice(0, 1))) is None  # not one run of the file
    assert read_stored_part(stored, spans["bf16"], (slice(0, 4, 2), )) is None
    with safe_open(str(stored), framework="pt") as handle:
        whole = handle.get_tensor("bf16").reshape(-1)
    assert torch.equal(read_stored_range(stored, spans["bf16"], 11, 97), whole[11:97])


def test_a_truncated_file_is_one_line_naming_it(stored, tmp_path):
    spans = stored_spans(stored)
    data = stored.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:spans["u8"].start + 10])  # inside u8's bytes
    with pytest.raises(CheckpointError, match="cut.safetensors: ends inside tensor data"):
        read_stored_part(cut, spans["u8"], ())
    with pytest.raises(CheckpointError, match="past a tensor of shape"):
        read_stored_range(stored, spans["i64"], 5, 11)
    assert "u8" not in stored_spans(cut)  # offsets past the file's end: left to safetensors, which says so


def test_writer_threads_are_one_a_core_each_on_one_torch_thread():
    seen = []
    lock = threading.Lock()

    def record() -> None:
        with lock:
            seen.append((threading.current_thread().name, torch.get_num_threads()))

    with serialization.BackgroundWriter() as writer:
        for _ in range(8):
            writer.submit(record)
    assert {count for _, count in seen} == {1}
    assert serialization.worker_threads() == max(2, serialization.usable_cores())
    assert torch.get_num_threads() >= 1  # the calling thread's own setting is untouched


@pytest.mark.parametrize("family, release", [("gpt-oss", "mxfp4"), ("gpt-oss", None), ("qwen3-moe", None),
                                             ("deepseek-v3", "fp8")])
def test_an_expert_stack_streams_in_blocks_smaller_than_an_expert(tmp_path, family, release):
    """A release's expert weights, fused in the files (gpt-oss, MXFP4 or bf16) or one tensor an expert and a
    projection (Qwen3-MoE, DeepSeek-V3 in block-FP8), stream in blocks cut inside an expert, and the blocks make
    the tensor the whole-tensor read gives."""
    from deepspeed_ext.api import open_checkpoint
    from deepspeed_ext.checkpoint.tensor import MASTER_WEIGHTS
    from deepspeed_ext.demo.models import build_model
    from harness import releases
    model = build_model(family, seed=3).to(torch.bfloat16)
    directory = tmp_path / family
    if release == "mxfp4":
        releases.write_mxfp4(model, directory)
    elif release == "fp8":
        releases.write_fp8(model, directory, block=(16, 16))
    else:
        releases.save(model, directory)
    stacks = [tensor for tensor in open_checkpoint(directory).tensors() if len(tensor.shape) == 3]
    assert stacks
    for tensor in stacks:
        row = tensor.shape[-1]
        # MXFP4 blocks are cut at its 32-row groups (range_row), which share scales along the rows
        unit = tensor.range_row or row
        assert unit == (32 * row if release == "mxfp4" else row), tensor.name
        blocks = list(tensor.blocks(MASTER_WEIGHTS, block_elements=3 * row))
        assert all(block.numel() % unit == 0 for block in blocks[:-1]), tensor.name
        assert max(block.numel() for block in blocks) <= max(3 * row, unit) < tensor.shape[1] * row, tensor.name
        assert torch.equal(torch.cat(blocks), tensor.load_tensor(MASTER_WEIGHTS).reshape(-1)), tensor.name
