"""The layouts LoRA adapters take under AutoTP, from their base layer's (no engine: plain layouts)."""

from __future__ import annotations

import pytest
import torch

from deepspeed_ext.errors import LayoutError
from deepspeed_ext.module_inject.adapters_tp import pair_layouts
from deepspeed_ext.module_inject.layout import TPLayout


def pair(in_features: int, out_features: int, r: int, bias: bool = False) -> tuple[torch.nn.Linear, torch.nn.Linear]:
    return torch.nn.Linear(in_features, r, bias=False), torch.nn.Linear(r, out_features, bias=bias)


def test_a_column_base_splits_lora_b_rows_and_its_bias_as_its_own_rows():
    base = TPLayout.split((48, 64), 3, 0, (24, 12, 12), "column")
    lora_a, lora_b = pair(64, 48, 4, bias=True)
    (a, a_layout), (b, b_layout), (bias, bias_layout) = pair_layouts("column", base, lora_a, lora_b)
    assert a is lora_a.weight and a_layout.is_replicated and a_layout.shape == (4, 64)
    assert b is lora_b.weight and b_layout.shape == (48, 4) and b_layout.shard_widths == ((24, 12, 12), )
    assert [b_layout.local_shape(rank) for rank in range(3)] == [(24, 4), (12, 4), (12, 4)]
    assert bias is lora_b.bias and bias_layout.shape == (48, ) and bias_layout.shard_widths == ((24, 12, 12), )
    full = torch.arange(48 * 4.0).view(48, 4)
    assert torch.equal(torch.cat([b_layout.slice(full, rank) for rank in range(3)]), full)


def test_a_row_base_splits_lora_a_columns_and_keeps_lora_b_and_its_bias_whole():
    base = TPLayout.split((64, 160), 2, 1, (80, 80), "row")
    lora_a, lora_b = pair(160, 64, 8, bias=True)
    layouts = [layout for _, layout in pair_layouts("row", base, lora_a, lora_b)]
    assert layouts[0].shape == (8, 160) and layouts[0].partition_dim == 1 and layouts[0].local_shape(1) == (8, 80)
    assert layouts[1].is_replicated and layouts[1].shape == (64, 8)
    assert layouts[2].is_replicated and layouts[2].shape == (64, )


def test_a_fused_qkv_base_cuts_lora_b_into_each_projections_share():
    """Fused q/k/v of unequal size: each rank's lora_B rows are its q, k and v rows, as the base weight's are."""
    base = TPLayout.sub_params((96, 64), 2, 0, (64, 16, 16), ((32, 32), (8, 8), (8, 8)), role="fused_qkv")
    lora_a, lora_b = pair(64, 96, 4)
    b_layout = pair_layouts("column", base, lora_a, lora_b)[1][1]
    full = torch.arange(96.0).unsqueeze(1).expand(96, 4).contiguous()
    rank1 = b_layout.slice(full, 1)[:, 0].tolist()
    assert rank1 == list(range(32, 64)) + list(range(72, 80)) + list(range(88, 96))


def test_a_whole_layer_keeps_both_factors_whole():
    base = TPLayout.split((256, 64), 2, 0, (128, 128), "column")
    layouts = [layout for _, layout in pair_layouts("whole", base, *pair(64, 256, 4))]
    assert all(layout.is_replicated for layout in layouts)


def test_a_split_no_adapter_can_follow_is_refused():
    base = TPLayout.split((64, 64), 2, 1, (32, 32), "row")
    with pytest.raises(LayoutError, match="cannot follow"):
        pair_layouts("column", base, *pair(64, 64, 4))
