"""peft LoRA adapters under AutoTP: each adapter is cut as AutoTP cuts the linear layer it sits on, and the sums the
cut makes partial are taken over the TP ranks, so a TP run trains the model a TP=1 run trains.

DeepSpeed's AutoTP replaces a peft LoRA layer by a shard of its base weight, losing the adapters. Around AutoTP's
pass (:func:`adapters_kept_under_autotp`), every LoRA layer over a linear steps aside, AutoTP shards the plain model,
and the LoRA layer returns over the AutoTP layer cut from its base. Then, per adapter (``y = W x + B A x``):

``column`` (the base takes the whole input and gives its rows of the output)
    ``lora_B`` keeps the base weight's rows (and its bias those of the bias), ``lora_A`` is whole. The r-wide
    activation ``A x`` is the same on every rank; it enters the TP region (identity forward, gradient summed over
    the ranks), since each rank's ``B`` sees only its rows of the output: ``A``'s gradient and the input's are then
    whole. With LoRA dropout each rank draws its own mask from the global generator (which activation checkpointing
    replays), so the sum moves before the dropout: the input's gradient is summed there and ``A``'s by a hook.
``row`` (the base takes its columns of the input, and its outputs are summed)
    ``lora_A`` keeps the base weight's columns, ``lora_B`` is whole; ``A``'s partial product is summed over the
    ranks (its gradient passes unchanged), as the base layer's output is.
``whole`` (whole input, whole output: a head that gathers its output)
    The adapter is left whole.

Each adapter tensor is broadcast from TP rank 0 before it is cut (ranks whose peft drew other initial values agree),
sharded ones are marked for DeepSpeed's gradient norm, and :func:`adapter_layouts` gives the
:class:`~deepspeed_ext.module_inject.layout.TPLayout` of each, which the checkpoints record.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from deepspeed_ext.checkpoint import engine_private
from deepspeed_ext.checkpoint.engine_private.autotp_hook import around_autotp, tp_process_group
from deepspeed_ext.checkpoint.engine_private.autotp_layers import (
    adapter_split,
    autotp_param_layouts,
    is_autotp_layer,
    mark_tensor_parallel,
)
from deepspeed_ext.errors import LayoutError, UnsupportedGeometryError
from deepspeed_ext.module_inject.layout import TPLayout, num_kv_heads_of
from deepspeed_ext.module_inject.peft_layers import LoraLinear, lora_layers, lora_linears
from deepspeed_ext.module_inject.tp_collectives import (
    GradSummedOverTP,
    InputEntersTP,
    OutputSummedOverTP,
    from_first_rank,
)

__all__ = ["adapter_layouts", "adapters_kept_under_autotp", "pair_layouts"]


# --------------------------------------------------------------------------- the layouts
def _lora_b_layout(base: TPLayout, r: int) -> TPLayout:
    """``lora_B`` (out x r) of a column base: the base weight's split of its output rows, with r columns."""
    view = base.logical_shape
    if len(base.shape) != 2 or base.dim >= len(view) - 1 or view[-1] != base.shape[-1]:
        raise LayoutError(f"a LoRA adapter cannot follow the split {base.describe()} of its base weight")
    return dataclasses.replace(base, shape=(base.shape[0], r),
                               view_shape=None if base.view_shape is None else (*view[:-1], r))


def _lora_a_layout(base: TPLayout, r: int) -> TPLayout:
    """``lora_A`` (r x in) of a row base: the base weight's split of its input columns, with r rows."""
    view = base.logical_shape
    if len(base.shape) != 2 or base.dim == 0 or view[0] != base.shape[0]:
        raise LayoutError(f"a LoRA adapter cannot follow the split {base.describe()} of its base weight")
    return dataclasses.replace(base, shape=(r, base.shape[1]),
                               view_shape=None if base.view_shape is None else (r, *view[1:]))


def _rows_layout(weight: TPLayout) -> TPLayout:
    """The bias beside a weight whose output rows are split as ``weight``'s: the same split of a vector."""
    view = weight.logical_shape
    return dataclasses.replace(weight, shape=(weight.shape[0], ),
                               view_shape=None if weight.view_shape is None else tuple(view[:-1]))


def pair_layouts(split: str, base: TPLayout, lora_a: Any, lora_b: Any) -> list[tuple[torch.nn.Parameter, TPLayout]]:
    """Every parameter of one adapter (``lora_A``, ``lora_B`` and its bias) with its full layout, from the ``split`` of
    the AutoTP layer it sits on and that layer's weight layout ``base``."""
    shape = engine_private.stored_shape  # the whole local shape, also of a ZeRO-3 partitioned parameter
    r = shape(lora_a.weight)[0] if split != "row" else shape(lora_b.weight)[1]
    tp = base.tp_size
    a_layout = _lora_a_layout(base, r) if split == "row" else TPLayout.replicated(shape(lora_a.weight), tp)
    b_layout = _lora_b_layout(base, r) if split == "column" else TPLayout.replicated(shape(lora_b.weight), tp)
    found = [(lora_a.weight, a_layout), (lora_b.weight, b_layout)]
    if getattr(lora_a, "bias", None) is not None:
        found.append((lora_a.bias, TPLayout.replicated(shape(lora_a.bias), tp)))
    if getattr(lora_b, "bias", None) is not None:
        found.append((lora_b.bias, _rows_layout(b_layout) if split == "column" else
                      TPLayout.replicated((b_layout.shape[0], ), tp)))
    return found


def _placed_adapters(model: torch.nn.Module, base_layouts: dict[int, TPLayout]
                     ) -> Iterator[tuple[LoraLinear, str, TPLayout]]:
    """``(LoRA layer, split, its base weight's layout)`` of every LoRA layer that sits on an AutoTP layer."""
    for lora in lora_linears(model, base_is=is_autotp_layer):
        split = adapter_split(lora.base)
        if split is None:
            raise UnsupportedGeometryError(f"LoRA layer {lora.name!r} sits on AutoTP's {type(lora.base).__name__}, "
                                           "which no adapter can be split with; leave it out of target_modules")
        base = base_layouts.get(id(lora.base.weight))
        if base is None:
            raise LayoutError(f"LoRA layer {lora.name!r}: the layout of its base weight is unknown")
        yield lora, split, base


def adapter_layouts(model: torch.nn.Module, base_layouts: dict[int, TPLayout]) -> dict[int, TPLayout]:
    """``{id(param): layout}`` of the adapters of every LoRA layer over an AutoTP layer, given the AutoTP weights'
    layouts ``base_layouts`` (``{id(param): layout}``)."""
    found: dict[int, TPLayout] = {}
    for lora, split, base in _placed_adapters(model, base_layouts):
        for adapter in lora.adapter_names():
            for param, layout in pair_layouts(split, base, *lora.pair(adapter)):
                found[id(param)] = layout
    return found


# --------------------------------------------------------------------------- the pass around AutoTP
@dataclasses.dataclass
class _Aside:
    """What :func:`_step_aside` did: the LoRA layers over linears it detached, and every LoRA layer there was."""

    linears: list[LoraLinear]
    every_layer: dict[int, str]


def _step_aside(model: torch.nn.Module) -> _Aside:
    linears = lora_linears(model, base_is=lambda module: isinstance(module, torch.nn.Linear))
    for lora in linears:
        variants = lora.variants()
        if variants:
            raise UnsupportedGeometryError(f"LoRA layer {lora.name!r}: adapter(s) {variants} use a LoRA variant "
                                           "(DoRA, ...) whose forward needs the whole weight; under AutoTP train plain "
                                           "LoRA (use_dora=False) or set tensor_parallel.autotp_size to 1")
        for adapter in lora.adapter_names():
            if any(engine_private.is_zero3_param(param) for param in lora.pair(adapter)[0].parameters()):
                raise UnsupportedGeometryError(f"LoRA layer {lora.name!r}: its adapters were built under zero.Init, "
                                               "which AutoTP with adapters cannot cut; build the peft model outside "
                                               "zero.Init")
    every_layer = {id(layer): name for name, layer in lora_layers(model)}
    for lora in linears:
        lora.detach()
    return _Aside(linears, every_layer)


def _return(model: torch.nn.Module, aside: _Aside, sharded: bool, grain: int) -> None:
    for lora in aside.linears:
        lora.reattach()
    if not sharded:
        return
    left = {id(layer) for _, layer in lora_layers(model)}
    lost = [name for key, name in aside.every_layer.items() if key not in left]
    if lost:
        raise UnsupportedGeometryError(f"AutoTP replaced LoRA layer(s) {lost[:3]} and their adapters with them; leave "
                                       "those modules out of target_modules (or modules_to_save) under AutoTP")
    tp_size, tp_rank = engine_private.tp_group_info()
    group = tp_process_group()
    base_layouts = autotp_param_layouts(model, tp_size, num_kv_heads_of(getattr(model, "config", None)), grain)
    for lora, split, base in _placed_adapters(model, base_layouts):
        _cut(lora, split, base, tp_rank, group)


def _cut(lora: LoraLinear, split: str, base: TPLayout, tp_rank: int, group: Any) -> None:
    """Cut every adapter of ``lora`` for this TP rank and give it the collectives of its split."""
    if split != "whole":  # peft visits a mixed batch's adapters in a set's order, which differs between processes
        lora.refuse_mixed_batches(UnsupportedGeometryError(
            "peft's adapter_names= (a batch mixing adapters) cannot run under AutoTP: each TP rank would visit the "
            "adapters in another order and sum another adapter's sub-batch; use set_adapter instead"))
    for adapter in lora.adapter_names():
        lora_a, lora_b = lora.pair(adapter)
        dropout = lora.dropout_p(adapter)
        if split == "whole" and dropout > 0:
            raise UnsupportedGeometryError(f"LoRA layer {lora.name!r}: adapter {adapter!r} has lora_dropout={dropout} "
                                           "on a layer AutoTP keeps whole on every TP rank, where each rank would draw "
                                           "another mask; set its dropout to 0 or leave the layer out")
        for param, layout in pair_layouts(split, base, lora_a, lora_b):
            full = from_first_rank(param.data, group)
            param.data = layout.slice(full, tp_rank).clone(memory_format=torch.contiguous_format)
            if not layout.is_replicated:
                mark_tensor_parallel(param)
        if split == "column" and dropout == 0:
            lora_b.register_forward_pre_hook(InputEntersTP(group))
        elif split == "column":
            lora.dropout(adapter).register_forward_pre_hook(InputEntersTP(group))
            if lora_a.weight.requires_grad:  # a frozen adapter (inactive, or loaded for inference) has no gradient
                lora_a.weight.register_hook(GradSummedOverTP(group))
        elif split == "row":
            lora_a.register_forward_hook(OutputSummedOverTP(group))


def adapters_kept_under_autotp(grain: int = 1) -> Any:
    """A context in which ``deepspeed.initialize`` keeps (and cuts) a peft model's LoRA adapters when AutoTP shards
    the model; a model without LoRA layers, or a run without AutoTP, is untouched. ``grain``: the config's
    ``tp_grain_size`` (DeepSpeed releases whose layers do not record their splits follow it)."""
    return around_autotp(_step_aside, lambda model, aside, sharded: _return(model, aside, sharded, grain))
