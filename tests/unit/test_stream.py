"""A logical tensor streamed in blocks, and the checks that see it block by block (no engine, no files)."""

import math
from pathlib import Path

import pytest
import torch

from deepspeed_ext.checkpoint.fingerprint import Fingerprint, Fingerprints
from deepspeed_ext.checkpoint.source import SourceInfo
from deepspeed_ext.checkpoint.tensor import MASTER_WEIGHTS, FiniteCheck, LogicalTensor, RecordCheck
from deepspeed_ext.errors import CheckpointError
from deepspeed_ext.module_inject.layout import TPLayout


def _tensor(full: torch.Tensor, reads: list[tuple[int, int]] | None = None, ranged: bool = True) -> LogicalTensor:
    flat = full.reshape(-1)

    def range_loader(state: str, low: int, high: int) -> torch.Tensor:
        if reads is not None:
            reads.append((low, high))
        return flat[low:high]

    return LogicalTensor(name="w", shape=tuple(full.shape), layout=TPLayout.replicated(full.shape, 1),
                         states=(MASTER_WEIGHTS, ), loader=lambda state: full,
                         range_loader=range_loader if ranged else None)


@pytest.mark.parametrize("shape, low, high, block", [((100, 7), 0, None, 50), ((100, 7), 13, 600, 64), ((9, ), 2, 9, 4),
                                                     ((3, 5000), 0, None, 64), ((0, 4), 0, None, 8)])
def test_blocks_cover_the_range_once_cut_at_whole_rows(shape, low, high, block):
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    reads: list[tuple[int, int]] = []
    blocks = list(_tensor(full, reads).blocks(MASTER_WEIGHTS, low, high, block_elements=block))
    end = full.numel() if high is None else high
    assert torch.equal(torch.cat(blocks) if blocks else torch.empty(0), full.reshape(-1)[low:end])
    row = math.prod(shape[1:])
    step = max(1, block // row) * row
    assert all(b % step == 0 for _, b in reads[:-1])  # every inner boundary on a multiple of whole rows
    assert [r[0] for r in reads[1:]] == [r[1] for r in reads[:-1]]  # consecutive, no overlap


def test_a_source_without_ranges_gives_one_block():
    full = torch.randn(6, 4)
    (block, ) = _tensor(full, ranged=False).blocks(MASTER_WEIGHTS, 3, 17)
    assert torch.equal(block, full.reshape(-1)[3:17])


def test_checks_see_every_block():
    full = torch.randn(64, 8)
    info = SourceInfo(format="test", given=Path("src"), path=Path("src"), layouts={"w": TPLayout.replicated(full.shape, 1)},
                      states=(MASTER_WEIGHTS, ),
                      fingerprints=Fingerprints({"w": {MASTER_WEIGHTS: Fingerprint.of(full)}}))
    record, finite = RecordCheck(info.fingerprints, str(info.given)), FiniteCheck("src")
    (checked, ) = finite.stream(record.stream([_tensor(full)]))
    for _ in checked.blocks(MASTER_WEIGHTS, block_elements=40):
        pass
    record.raise_if_wrong()  # the blocks add up to the record
    finite.raise_if_any()

    damaged = full.clone()
    damaged[50, 3] = float("nan")
    record, finite = RecordCheck(info.fingerprints, str(info.given)), FiniteCheck("src")
    (checked, ) = finite.stream(record.stream([_tensor(damaged)]))
    for _ in checked.blocks(MASTER_WEIGHTS, block_elements=40):
        pass
    with pytest.raises(CheckpointError, match="NaN/Inf in 1 parameter"):
        finite.raise_if_any()
    with pytest.raises(CheckpointError, match="'w'"):
        record.raise_if_wrong()
