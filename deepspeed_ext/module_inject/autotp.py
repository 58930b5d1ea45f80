"""Tag the parameters of a model that DeepSpeed AutoTP has sharded with a :class:`TPLayout` each.

Three sources of layouts, in order of preference:

1. :func:`tag_autotp_model` — read each AutoTP layer's structure (class, full shape, the shard sizes
   the layer froze when it cut the weight). On DeepSpeed releases whose layers do not record their
   sizes, the sizes come from :func:`~deepspeed_ext.module_inject.layout.shard_sizes`, the same rule
   AutoTP uses. Every layout is checked against the shard actually left in the parameter.
2. :func:`layout_from_upstream_meta` — DeepSpeed ≥ 0.18.9 also tags parameters itself
   (``ds_autotp_universal_checkpoint_meta``); we translate that when we meet a layer we do not know.
3. :func:`layouts_from_universal_checkpoint_info` — a checkpoint saved without deepspeed-ext still
   carries upstream's model-level ``universal_checkpoint_info`` plus per-rank local shapes; that is
   enough to rebuild every layout.
"""

from __future__ import annotations

from typing import Any

import torch

from deepspeed_ext.checkpoint.engine_private import stored_shape
from deepspeed_ext.checkpoint.engine_private.autotp_layers import UPSTREAM_META_ATTR as UPSTREAM_META_ATTR
from deepspeed_ext.errors import LayoutError
from deepspeed_ext.module_inject.layout import TPLayout, num_kv_heads_of
from deepspeed_ext.module_inject.upstream import layout_from_upstream_meta as layout_from_upstream_meta
from deepspeed_ext.module_inject.upstream import (
    layouts_from_universal_checkpoint_info as layouts_from_universal_checkpoint_info,
)
from deepspeed_ext.module_inject.upstream import name_patterns as name_patterns
from deepspeed_ext.module_inject.upstream import unsharded_weights as unsharded_weights

#: Attribute we attach to every tagged parameter.
LAYOUT_ATTR = "ds_ext_tp_layout"
#: Set on a parameter whose layout's shards are not TP ranks (AutoEP experts: EP ranks): the shard it holds.
SHARD_RANK_ATTR = "ds_ext_shard_rank"


def tag_autotp_model(model: torch.nn.Module,
                     *,
                     tp_size: int | None = None,
                     tp_rank: int | None = None,
                     model_config: Any = None,
                     tp_grain_size: int = 1,
                     use_layer_sizes: bool = True) -> dict[str, TPLayout]:
    """Attach a :class:`TPLayout` to every parameter of ``model`` and return ``{name: layout}``.

    Parameters outside AutoTP layers are replicated. Shard sizes come from what each layer froze when
    it cut its weight (``use_layer_sizes``), else from :func:`shard_sizes` (older DeepSpeed). Each
    layout's :meth:`~TPLayout.local_shape` for this rank is checked against the parameter's actual
    shard; a mismatch raises LayoutError naming the parameter rather than letting a wrong layout
    reach a checkpoint.
    """
    if tp_size is None or tp_rank is None:
        from deepspeed_ext.checkpoint.engine_private import tp_group_info  # the fence: only when asked
        tp_size, tp_rank = tp_group_info()
    if model_config is None:
        model_config = getattr(model, "config", None)
    num_kv_heads = num_kv_heads_of(model_config)

    from deepspeed_ext.checkpoint.engine_private.autotp_layers import autotp_param_layouts
    from deepspeed_ext.module_inject.adapters_tp import adapter_layouts
    from deepspeed_ext.module_inject.linear_attention_tp import linear_attention_layouts
    by_param = autotp_param_layouts(model, tp_size, num_kv_heads, tp_grain_size, use_layer_sizes)
    by_param.update(adapter_layouts(model, by_param))
    by_param.update(linear_attention_layouts(model))

    layouts: dict[str, TPLayout] = {}
    for name, param in model.named_parameters(remove_duplicate=True):
        layout = by_param.get(id(param)) or TPLayout.replicated(stored_shape(param), tp_size)
        local = stored_shape(param)
        if layout.local_shape(tp_rank) != local:
            raise LayoutError(f"parameter {name!r}: layout {layout.describe()} gives TP rank {tp_rank} a shard of "
                              f"{layout.local_shape(tp_rank)}, but the parameter holds {local}")
        setattr(param, LAYOUT_ATTR, layout)
        layouts[name] = layout
    layouts.update(tag_expert_params(model))
    return layouts


def tag_expert_params(model: torch.nn.Module) -> dict[str, TPLayout]:
    """AutoEP's stacked expert parameters: their logical ``[experts, ...]`` tensor split over the EP ranks along
    dim 0 (:func:`~deepspeed_ext.checkpoint.deepspeed.experts.expert_layout`), with this rank's EP rank, the shard
    it holds, under :data:`SHARD_RANK_ATTR`. ``{name: layout}`` of those it tagged."""
    from deepspeed_ext.checkpoint.deepspeed.experts import expert_layout
    from deepspeed_ext.checkpoint.engine_private import autoep_layers  # the fence: only when asked
    layouts: dict[str, TPLayout] = {}
    names = {id(param): name for name, param in model.named_parameters(remove_duplicate=True)}
    for layer in autoep_layers(model):
        if layer.num_experts % layer.ep_size:
            raise LayoutError(f"AutoEP layer with {layer.num_experts} experts over EP={layer.ep_size}: not an even "
                              "split, which deepspeed-ext's expert layout assumes")
        per_rank = [layer.num_experts // layer.ep_size] * layer.ep_size
        for full_name, param in layer.params.items():
            local = stored_shape(param)
            layout = expert_layout((layer.num_experts, *local[1:]), per_rank)
            if layout.local_shape(layer.ep_rank) != local:
                raise LayoutError(f"expert parameter {full_name!r}: EP rank {layer.ep_rank} of {layer.ep_size} should "
                                  f"hold {layout.local_shape(layer.ep_rank)}, but holds {local}")
            setattr(param, LAYOUT_ATTR, layout)
            setattr(param, SHARD_RANK_ATTR, layer.ep_rank)
            layouts[names.get(id(param), full_name)] = layout
    return layouts


def shard_rank(param: torch.nn.Parameter, tp_rank: int) -> int:
    """Which shard of its layout ``param`` holds: its EP rank for an AutoEP expert stack, else the TP rank."""
    rank: int = getattr(param, SHARD_RANK_ATTR, tp_rank)
    return rank


def upstream_layouts(model: torch.nn.Module, tp_size: int | None = None) -> dict[str, TPLayout]:
    """Layouts read from DeepSpeed's own per-parameter metadata (replicated where it left none)."""
    if tp_size is None:
        from deepspeed_ext.checkpoint.engine_private import tp_group_info
        tp_size, _ = tp_group_info()
    layouts = {}
    for name, param in model.named_parameters(remove_duplicate=True):
        meta = getattr(param, UPSTREAM_META_ATTR, None)
        layouts[name] = (TPLayout.replicated(stored_shape(param), tp_size)
                         if meta is None else layout_from_upstream_meta(meta, tp_size))
    return layouts


