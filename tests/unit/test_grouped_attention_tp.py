"""DeepSeek-V4's attention split by output groups (deepspeed_ext.module_inject.grouped_attention_tp), without a process
group: which layers are found, what each TP degree splits or leaves whole, and the layouts of what it cuts. The
split itself trains as TP=1 does in tests/e2e/test_recent_families_e2e.py (deepseek-v4)."""

from __future__ import annotations

import torch

from deepspeed_ext.demo.models import build_model
from deepspeed_ext.module_inject import grouped_attention_tp as grouped


def test_v4_attention_splits_by_whole_output_groups_or_stays_whole_saying_why():
    model = build_model("deepseek-v4")
    layers = grouped.grouped_attention_layers(model)
    assert [name for name, _ in layers] == [f"model.layers.{i}.self_attn" for i in range(3)]
    assert grouped.grouped_attention_layers(build_model("deepseek-v3.2")) == []  # MLA: no grouped output
    _, layer = layers[1]  # 12 heads in 6 output groups
    assert grouped._why_whole(layer, 2) is None and grouped._why_whole(layer, 3) is None
    assert grouped._why_whole(layer, 4) == "6 output groups do not divide by TP=4"
    layouts = grouped._layouts(layer, 3)
    assert {name: (layout.partition_dim, layout.local_shape(2)) for name, layout in layouts.items()} == {
        "q_b_proj.weight": (0, (64, 32)), "o_a_proj.weight": (0, (16, 32)), "sinks": (0, (4, )),
        "o_b_proj.weight": (1, (64, 16))}
    layer.q_b_proj = torch.nn.Sequential(layer.q_b_proj)  # not the model's own projection (an adapter, say)
    assert "not the model's own" in grouped._why_whole(layer, 2)
