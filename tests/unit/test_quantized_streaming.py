"""``to-hf --quantize`` streams: a weight written quantized is read a block of whole tiles at a time (FP8 tile rows,
MXFP4 blocks of an expert's rows, the power-of-two tiles of DeepSeek-V4's format), on the writer threads, and the
files are those of each weight quantized whole."""

from __future__ import annotations

import threading

import pytest
import torch

from deepspeed_ext.api import open_checkpoint
from deepspeed_ext.checkpoint.hf import quantized
from deepspeed_ext.checkpoint.universal.reader import UniversalCheckpoint
from deepspeed_ext.demo.models import build_model
from harness import releases
from harness.hf import cli, read_files

#: Elements per block while streaming: smaller than every quantized weight of the tiny models, so each is read in
#: several blocks (one tile row, 32 rows of an expert, or fewer elements where a row is longer).
SMALL_BLOCK = 64


def _release(case, root):
    model = build_model({"fp8": "llama", "mxfp4": "gpt-oss", "pow2": "deepseek-v4"}[case], seed=7)
    model = model.to(torch.bfloat16)
    if case == "fp8":
        return releases.write_fp8(model, root / "release")
    if case == "mxfp4":
        return releases.write_mxfp4(model, root / "release")
    from harness.deepseek_v4_release import write_release
    return write_release(model, root / "release", block=(16, 16))


def _written_values(files: dict[str, torch.Tensor]) -> int:
    """The values the files hold quantized (FP8 one a byte; FP4 and MXFP4 two), but the MTP layer's (copied
    from the release, not read from the universal checkpoint)."""
    fp8 = sum(t.numel() for n, t in files.items() if t.dtype == torch.float8_e4m3fn and not n.startswith("mtp."))
    fp4 = sum(t.numel() for n, t in files.items()
              if (t.dtype == torch.int8 or n.endswith("_blocks")) and not n.startswith("mtp."))
    return fp8 + 2 * fp4


@pytest.mark.parametrize("case", ["fp8", "mxfp4", "pow2"])
def test_quantized_weights_are_read_in_blocks_and_written_as_quantized_whole(case, tmp_path, monkeypatch):
    release = _release(case, tmp_path)
    cli("from-hf", str(release), "-o", str(tmp_path / "u"), *(["--mtp", "drop"] if case == "pow2" else []))
    shapes = {t.name: tuple(t.shape) for t in open_checkpoint(tmp_path / "u").tensors()}
    quantize = {"fp8": ["--quantize", "fp8", "--fp8-block", "8x16"], "mxfp4": ["--quantize", "mxfp4"],
                "pow2": ["--like", str(release), "--quantize", "fp8", "--fp8-block", "16x16"]}[case]
    # The reference: every weight of these tiny models in one block, quantized whole.
    cli("to-hf", str(tmp_path / "u"), "-o", str(tmp_path / "whole"), *quantize)

    reads: list[tuple[str, int, int]] = []  # (parameter, low, high) read on a writer thread
    full_range = UniversalCheckpoint.full_range

    def recorded(self, name, state, low, high):
        if threading.current_thread().name.startswith("deepspeed-ext-writer"):
            reads.append((name, low, high))
        return full_range(self, name, state, low, high)

    monkeypatch.setattr(UniversalCheckpoint, "full_range", recorded)
    monkeypatch.setattr(quantized, "BLOCK_ELEMENTS", SMALL_BLOCK)
    cli("to-hf", str(tmp_path / "u"), "-o", str(tmp_path / "blocks"), *quantize)

    whole, blocks = read_files(tmp_path / "whole"), read_files(tmp_path / "blocks")
    assert sorted(blocks) == sorted(whole)
    for name, tensor in whole.items():
        assert blocks[name].dtype == tensor.dtype and blocks[name].view(torch.uint8).equal(
            tensor.view(torch.uint8)), name
    # Every value written quantized was read once, on a writer thread, in blocks no larger than 32 rows.
    assert sum(high - low for _, low, high in reads) == _written_values(whole) > 0
    for name, low, high in reads:
        assert high - low <= max(SMALL_BLOCK, 32 * shapes[name][-1]), (name, low, high)
    largest = max(high - low for _, low, high in reads)
    assert largest < max(torch.Size(shapes[name]).numel() for name, _, _ in reads)
