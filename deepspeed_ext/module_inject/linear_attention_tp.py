"""Gated-DeltaNet linear attention (Qwen3.5, Qwen3-Next) split by heads over the TP ranks.

The DeltaNet recurrence runs per value head, and each value head reads one key head (``num_v_heads / num_k_heads``
value heads per key head, adjacent). So a rank that holds whole key heads and their value heads computes its heads'
outputs alone, as attention heads are computed: the layer is split like attention, by groups of heads. AutoTP only
splits ``nn.Linear`` weights, and the layer's per-head state is more than that (the short convolution over q, k and
v, the decay ``A_log`` and the step bias ``dt_bias``) and its sizes are attributes the forward reads, so
deepspeed-ext cuts it itself, right after AutoTP's pass (the optimizer is built on the cut parameters):

* the input projections keep their rows of this rank's heads: Qwen3.5's ``in_proj_qkv`` as three parts (q, k, v
  rows, each split), ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a`` plainly; Qwen3-Next's ``in_proj_qkvz`` and
  ``in_proj_ba`` are laid out per key head, so a plain split of their rows keeps whole groups;
* the depthwise convolution keeps its q, k and v channels of those heads (three parts), ``A_log`` and ``dt_bias``
  their value heads; the layer's head counts and widths become this rank's;
* ``out_proj`` keeps its input columns, and its output is summed over the ranks; the layer's input enters the TP
  region (its gradient is summed); the gated norm's weight, shared by every head, stays whole with its gradient
  summed.

Each cut parameter is marked for DeepSpeed's gradient norm and carries its
:class:`~deepspeed_ext.module_inject.layout.TPLayout` (:func:`linear_attention_layouts`), which the checkpoints
record. A layer is left whole (and named) where the key heads do not divide by the TP degree, or where a projection
is not a plain ``nn.Linear`` (a LoRA adapter on it, or AutoTP split it by a user's own specs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from deepspeed_ext.checkpoint import engine_private
from deepspeed_ext.checkpoint.engine_private.autotp_hook import around_autotp, tp_process_group
from deepspeed_ext.checkpoint.engine_private.autotp_layers import mark_tensor_parallel
from deepspeed_ext.module_inject.layout import TPLayout
from deepspeed_ext.module_inject.tp_collectives import (GradSummedOverTP, HiddenStatesEnterTP, OutputSummedOverTP,
                                                        from_first_rank)

__all__ = ["linear_attention_layouts", "linear_attention_split", "split_linear_attention"]

#: Where a cut parameter keeps its layout until the model is tagged.
LAYOUT_ATTR = "ds_ext_head_split_layout"
#: The separate projections (Qwen3.5) and the fused ones laid out per key head (Qwen3-Next).
_SEPARATE = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
_FUSED = ("in_proj_qkvz", "in_proj_ba")
_SIZES = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "key_dim", "value_dim", "conv_dim")


def deltanet_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The gated-DeltaNet layers of ``model``: modules with its head sizes, convolution, decay and projections."""
    return [(name, module) for name, module in model.named_modules()
            if all(hasattr(module, attr) for attr in (*_SIZES, "conv1d", "A_log", "dt_bias", "out_proj"))
            and (all(hasattr(module, p) for p in _SEPARATE) or all(hasattr(module, p) for p in _FUSED))]


def _projections(layer: Any) -> tuple[str, ...]:
    return _FUSED if hasattr(layer, "in_proj_qkvz") else _SEPARATE


def even_shares(total: int, tp_size: int) -> tuple[int, ...]:
    return (total // tp_size, ) * tp_size


def _layouts(layer: Any, tp_size: int) -> dict[str, TPLayout]:
    """The TP layout of each parameter the cut splits, by its name in ``layer``."""
    k, v = layer.key_dim, layer.value_dim
    layouts: dict[str, TPLayout] = {}

    def rows(name: str, shape: tuple[int, ...], parts: tuple[int, ...]) -> None:
        layouts[name] = (TPLayout.split(shape, tp_size, 0, even_shares(shape[0], tp_size), "column") if len(parts) == 1
                         else TPLayout.sub_params(shape, tp_size, 0, parts, [even_shares(p, tp_size) for p in parts]))

    for projection in _projections(layer):
        weight = getattr(layer, projection).weight
        parts = (k, k, v) if projection == "in_proj_qkv" else (weight.shape[0], )
        rows(f"{projection}.weight", tuple(weight.shape), parts)
    rows("conv1d.weight", tuple(layer.conv1d.weight.shape), (k, k, v))
    for vector in ("A_log", "dt_bias"):
        rows(vector, tuple(getattr(layer, vector).shape), (getattr(layer, vector).shape[0], ))
    out = tuple(layer.out_proj.weight.shape)
    layouts["out_proj.weight"] = TPLayout.split(out, tp_size, 1, even_shares(out[1], tp_size), "row")
    return layouts


def _why_whole(layer: Any, tp_size: int) -> str | None:
    if layer.num_k_heads % tp_size:
        return f"{layer.num_k_heads} key heads do not divide by TP={tp_size}"
    linears = [getattr(layer, name) for name in (*_projections(layer), "out_proj")]
    if any(type(linear) is not torch.nn.Linear for linear in linears):
        return "a projection is not a plain nn.Linear (a LoRA adapter on it, or split by the tensor-parallel specs)"
    if layer.conv1d.bias is not None:
        return "its convolution has a bias"
    return None


def split_linear_attention(model: torch.nn.Module, tp_rank: int, tp_size: int, group: Any) -> dict[str, str]:
    """Cut every gated-DeltaNet layer of ``model`` for TP rank ``tp_rank`` of ``tp_size`` (see the module's text);
    ``{layer name: why}`` of those left whole."""
    whole: dict[str, str] = {}
    layer: Any
    for name, layer in deltanet_layers(model):
        reason = _why_whole(layer, tp_size)
        if reason is not None:
            whole[name] = reason
            continue
        params = dict(layer.named_parameters())
        for param_name, layout in _layouts(layer, tp_size).items():
            cut_to_rank(params[param_name], layout, tp_rank, group)
        for size in ("num_k_heads", "num_v_heads", "key_dim", "value_dim", "conv_dim"):
            setattr(layer, size, getattr(layer, size) // tp_size)
        conv = layer.conv1d
        conv.in_channels = conv.out_channels = conv.groups = layer.conv_dim
        for projection in (*_projections(layer), "out_proj"):
            linear = getattr(layer, projection)
            linear.out_features, linear.in_features = linear.weight.shape
        norm = getattr(layer, "norm", None)
        for param in (norm.parameters() if norm is not None else ()):
            param.data = from_first_rank(param.data, group)
            if param.requires_grad:
                param.register_hook(GradSummedOverTP(group))
        layer.register_forward_pre_hook(HiddenStatesEnterTP(group), with_kwargs=True)
        layer.out_proj.register_forward_hook(OutputSummedOverTP(group))
    return whole


def linear_attention_layouts(model: torch.nn.Module) -> dict[int, TPLayout]:
    """``{id(param): layout}`` of the parameters :func:`split_linear_attention` cut."""
    return {id(param): getattr(param, LAYOUT_ATTR) for param in model.parameters() if hasattr(param, LAYOUT_ATTR)}


def linear_attention_split(warn: Callable[[str], None]) -> Any:
    """A context in which every engine whose model AutoTP shards gets its gated-DeltaNet layers split by heads
    (:func:`split_linear_attention`); the layers left whole are named in one line to ``warn``."""

    return split_after_autotp(deltanet_layers, split_linear_attention, "linear-attention", warn)


def cut_to_rank(param: torch.nn.Parameter, layout: TPLayout, tp_rank: int, group: Any) -> None:
    """``param`` replaced by TP rank ``tp_rank``'s slice of ``layout`` (of the first rank's values, on which the
    ranks agree before they cut), marked tensor-parallel for DeepSpeed and carrying its layout."""
    full = from_first_rank(param.data, group)
    param.data = layout.slice(full, tp_rank).clone(memory_format=torch.contiguous_format)
    mark_tensor_parallel(param)
    setattr(param, LAYOUT_ATTR, layout)


def split_after_autotp(find_layers: Callable[[torch.nn.Module], list[Any]],
                       split: Callable[[torch.nn.Module, int, int, Any], dict[str, str]], what: str,
                       warn: Callable[[str], None]) -> Any:
    """A context in which every engine whose model AutoTP shards and has layers ``find_layers`` finds gets them cut
    by ``split(model, tp_rank, tp_size, group)`` right after AutoTP's pass; the layers it leaves whole (``{name:
    why}``) are named in one line to ``warn``."""

    def after(model: torch.nn.Module, state: Any, sharded: bool) -> None:
        if not sharded or not find_layers(model):
            return
        tp_size, tp_rank = engine_private.tp_group_info()
        whole = split(model, tp_rank, tp_size, tp_process_group())
        if whole:
            name, reason = next(iter(whole.items()))
            warn(f"{len(whole)} {what} layer(s) stay whole on every TP rank, e.g. {name}: {reason}")

    return around_autotp(lambda model: None, after)
