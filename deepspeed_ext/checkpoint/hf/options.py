"""What `to-hf` may be told (:class:`HFOptions`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from deepspeed_ext.checkpoint.source import (
    WriteOptions,
)


@dataclass(frozen=True)
class HFOptions(WriteOptions):
    """``dtype``: of the weights written (``source``: the dtype the source model had); ``max_shard_size``: the
    largest safetensors file (bytes, or "5GB"); ``tokenizer``: a directory whose tokenizer files (and generation
    config) to add, for a source folder that has none."""

    dtype: str = "source"
    max_shard_size: int | str = "5GB"
    tokenizer: str | Path | None = None
    #: ``fp8`` (block FP8, tiles of ``fp8_block``) or ``mxfp4`` (gpt-oss's experts): write quantized weights.
    quantize: str | None = None
    fp8_block: tuple[int, int] = (128, 128)
    #: ``fp8``: also quantize weights that are not whole tiles, with partial tiles at the edges (DeepSeek-V3's
    #: release does; transformers 5.22 does not read those right, so by default they stay unquantized).
    fp8_edge_tiles: bool = False
    #: An HF directory (a multimodal or DeepSeek-V3 / V4 release) whose layout to write into: its naming, its config,
    #: and the tensors the source model lacks (a vision tower, a multi-token-prediction layer), copied; with
    #: ``quantize="fp8"``, a release with power-of-two scales (DeepSeek-V4's) is written in its own format.
    like: str | Path | None = None


