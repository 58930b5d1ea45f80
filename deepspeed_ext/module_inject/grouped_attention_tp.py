"""DeepSeek-V4's attention split by its output groups over the TP ranks.

V4's attention runs every query head against one key/value head (``kv_proj``, keys and values alike, plus the
compressor's pooled keys in compressed layers), adds a learned sink per head (``sinks``), and projects the heads out
in ``o_groups`` blocks of adjacent heads (``o_a_proj``, a block-diagonal grouped linear, each block to
``o_lora_rank``), mixed to the hidden size by ``o_b_proj``. A head's query, its sink and its group's block of
``o_a_proj`` are its own; so a rank holding whole output groups computes their heads' outputs alone, and the layer
splits like attention, by groups of heads. AutoTP cannot do it: its layers replace the grouped linear by a plain
matmul, and the shared key/value head reaches every head without passing a column-parallel layer, so its gradient
(and the residual stream's) would be each rank's part. So deepspeed-ext cuts it itself, right after AutoTP's pass
(the optimizer is built on the cut parameters):

* ``q_b_proj`` keeps the query rows of this rank's heads, ``sinks`` their sinks, ``o_a_proj`` the rows of this
  rank's groups, ``o_b_proj`` their input columns, and its output is summed over the ranks; the layer's head and
  group counts become this rank's;
* the layer's input enters the TP region (its gradient is summed); everything else in it (the low-rank query
  ``q_a_proj`` / ``q_a_norm``, the key/value head, the compressor and its indexer) stays whole, with its gradient
  summed (each rank's is its heads' part).

Each cut parameter is marked for DeepSpeed's gradient norm and carries its
:class:`~deepspeed_ext.module_inject.layout.TPLayout` under the attribute gated-DeltaNet's cut uses (read by
:func:`~deepspeed_ext.module_inject.linear_attention_tp.linear_attention_layouts`), which the checkpoints record. A
layer is left whole (and named) where its output groups do not divide by the TP degree, or where a projection is not
what the model built (a LoRA adapter on it, or AutoTP split it by a user's own specs).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from deepspeed_ext.module_inject.layout import TPLayout
from deepspeed_ext.module_inject.linear_attention_tp import cut_to_rank, even_shares, split_after_autotp
from deepspeed_ext.module_inject.tp_collectives import (GradSummedOverTP, HiddenStatesEnterTP, OutputSummedOverTP,
                                                        from_first_rank)

__all__ = ["grouped_attention_layers", "grouped_attention_split", "split_grouped_attention"]

#: What the layer's forward reads of itself: its projections, its sinks and its head counts.
_ATTRIBUTES = ("q_b_proj", "kv_proj", "o_a_proj", "o_b_proj", "sinks", "num_heads", "num_key_value_groups", "config")


def grouped_attention_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The attention layers of ``model`` with one shared key/value head and a grouped output projection."""
    return [(name, module) for name, module in model.named_modules()
            if all(hasattr(module, attr) for attr in _ATTRIBUTES) and hasattr(module.o_a_proj, "n_groups")]


def _layouts(layer: Any, tp_size: int) -> dict[str, TPLayout]:
    """The TP layout of each parameter the cut splits, by its name in ``layer``."""
    layouts = {}
    for name in ("q_b_proj.weight", "o_a_proj.weight", "sinks"):
        shape = tuple(layer.get_parameter(name).shape)
        layouts[name] = TPLayout.split(shape, tp_size, 0, even_shares(shape[0], tp_size), "column")
    out = tuple(layer.o_b_proj.weight.shape)
    layouts["o_b_proj.weight"] = TPLayout.split(out, tp_size, 1, even_shares(out[1], tp_size), "row")
    return layouts


def _why_whole(layer: Any, tp_size: int) -> str | None:
    groups = layer.o_a_proj.n_groups
    if groups % tp_size:
        return f"{groups} output groups do not divide by TP={tp_size}"
    if layer.num_heads % groups:
        return f"{layer.num_heads} heads are not whole groups of {groups}"
    plain = (type(layer.q_b_proj), type(layer.o_b_proj)) == (torch.nn.Linear, torch.nn.Linear)
    if not plain or "GroupedLinear" not in type(layer.o_a_proj).__name__ or any(
            linear.bias is not None for linear in (layer.q_b_proj, layer.o_a_proj, layer.o_b_proj)):
        return "a projection is not the model's own (a LoRA adapter on it, or split by the tensor-parallel specs)"
    return None


def split_grouped_attention(model: torch.nn.Module, tp_rank: int, tp_size: int, group: Any) -> dict[str, str]:
    """Cut every grouped-output attention layer of ``model`` for TP rank ``tp_rank`` of ``tp_size`` (see the
    module's text); ``{layer name: why}`` of those left whole."""
    whole: dict[str, str] = {}
    layer: Any
    for name, layer in grouped_attention_layers(model):
        reason = _why_whole(layer, tp_size)
        if reason is not None:
            whole[name] = reason
            continue
        layouts = _layouts(layer, tp_size)
        for param_name, param in layer.named_parameters():
            layout = layouts.get(param_name)
            if layout is not None:
                cut_to_rank(param, layout, tp_rank, group)
                continue
            param.data = from_first_rank(param.data, group)  # whole: the ranks agree, and its gradient is this
            if param.requires_grad:  # rank's heads' part
                param.register_hook(GradSummedOverTP(group))
        layer.num_heads //= tp_size
        layer.num_key_value_groups = layer.num_heads  # the one key/value head, repeated for this rank's heads
        layer.o_a_proj.n_groups //= tp_size
        # The forward reads the group count from the config; the layer gets a copy of its own.
        layer.config = copy.copy(layer.config)
        layer.config.o_groups = layer.o_a_proj.n_groups
        for linear in (layer.q_b_proj, layer.o_a_proj, layer.o_b_proj):
            linear.out_features, linear.in_features = linear.weight.shape
        layer.register_forward_pre_hook(HiddenStatesEnterTP(group), with_kwargs=True)
        layer.o_b_proj.register_forward_hook(OutputSummedOverTP(group))
    return whole


def grouped_attention_split(warn: Callable[[str], None]) -> Any:
    """A context in which every engine whose model AutoTP shards gets its grouped-output attention layers split by
    output groups (:func:`split_grouped_attention`); the layers left whole are named in one line to ``warn``."""

    return split_after_autotp(grouped_attention_layers, split_grouped_attention, "grouped-output attention",
                              warn)
