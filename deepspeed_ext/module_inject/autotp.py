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
from collections.abc import Sequence

import torch

from deepspeed_ext.errors import LayoutError
from deepspeed_ext.module_inject.layout import TPLayout, num_kv_heads_of, shard_sizes
from deepspeed_ext.module_inject.upstream import layout_from_upstream_meta as layout_from_upstream_meta
from deepspeed_ext.module_inject.upstream import \
    layouts_from_universal_checkpoint_info as layouts_from_universal_checkpoint_info
from deepspeed_ext.module_inject.upstream import name_patterns as name_patterns
from deepspeed_ext.module_inject.upstream import unsharded_weights as unsharded_weights

#: Attribute we attach to every tagged parameter.
LAYOUT_ATTR = "ds_ext_tp_layout"
#: Set on a parameter whose layout's shards are not TP ranks (AutoEP experts: EP ranks): the shard it holds.
SHARD_RANK_ATTR = "ds_ext_shard_rank"
#: Attribute DeepSpeed (>= 0.18.9) attaches to AutoTP parameters.
UPSTREAM_META_ATTR = "ds_autotp_universal_checkpoint_meta"


def _class_names(module: torch.nn.Module) -> set[str]:
    return {cls.__name__ for cls in type(module).__mro__}


def _full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """Shape of the local shard, also under ZeRO-3 where ``param.shape`` is an empty placeholder."""
    ds_shape = getattr(param, "ds_shape", None)
    return tuple(ds_shape) if ds_shape is not None else tuple(param.shape)


class _LayerReader:
    """Reads one AutoTP layer; ``sizes``/``widths`` prefer what the layer froze, else our rule."""

    def __init__(self,
                 layer: torch.nn.Module,
                 tp_size: int,
                 num_kv_heads: int | None,
                 grain: int,
                 use_layer_sizes: bool = True):
        self.layer = layer
        self.use_layer_sizes = use_layer_sizes
        self.tp_size = tp_size
        self.num_kv_heads = num_kv_heads
        self.grain = grain
        self.name = getattr(layer, "name", None)

    def rule(self, total: int, name: str | None = None) -> tuple[int, ...]:
        return shard_sizes(total,
                           self.tp_size,
                           name=self.name if name is None else name,
                           num_kv_heads=self.num_kv_heads,
                           grain=self.grain)

    def partition_sizes(self, total: int) -> tuple[int, ...]:
        frozen = getattr(self.layer, "_partition_sizes", None) if self.use_layer_sizes else None
        return tuple(frozen) if frozen is not None else self.rule(total)

    def gathered_sizes(self, local: int) -> tuple[int, ...]:
        """Every TP rank's size along the split dim, asked of the ranks themselves.

        Exact on any DeepSpeed version; used where a layer recorded neither its full shape nor its sizes
        (DeepSpeed < 0.19). Collective: every rank tags the same layers in the same order.
        """
        group = getattr(self.layer, "mp_group", None)
        if group is None or self.tp_size == 1:
            return (int(local), )
        import torch.distributed as dist
        mine = torch.tensor([int(local)], dtype=torch.int64)
        sizes = [torch.zeros_like(mine) for _ in range(self.tp_size)]
        dist.all_gather(sizes, mine, group=group)
        return tuple(int(size) for size in sizes)

    def plain_split(self,
                    param: torch.Tensor,
                    dim: int,
                    full_shape: Sequence[int] | None,
                    partition_type: str,
                    role: str | None = None) -> TPLayout:
        """A plain split of ``param`` along ``dim``: frozen/rule sizes if the full shape is known, else asked."""
        if full_shape is not None:
            sizes = self.partition_sizes(full_shape[dim])
        else:
            local = _full_shape(param)
            sizes = self.gathered_sizes(local[dim])
            full_shape = list(local)
            full_shape[dim] = sum(sizes)
        return TPLayout.split(tuple(full_shape), self.tp_size, dim, sizes, partition_type, role=role)

    def sub_param_widths(self, sub_sizes: Sequence[int], name: str | None = None) -> tuple[tuple[int, ...], ...]:
        frozen = getattr(self.layer, "_subparam_shard_widths", None) if self.use_layer_sizes else None
        if frozen is not None:
            return tuple(tuple(w) for w in frozen)
        return tuple(self.rule(size, name) for size in sub_sizes)


def _layer_layouts(layer: torch.nn.Module, reader: _LayerReader) -> dict[str, TPLayout] | None:
    """Layouts of a known AutoTP layer's direct parameters, keyed ``weight``/``bias``; None if unknown."""
    names = _class_names(layer)
    tp = reader.tp_size
    weight = getattr(layer, "weight", None)
    bias = getattr(layer, "bias", None)
    out: dict[str, TPLayout] = {}

    if "SubParamLinearLayer" in names or "SubParamLinearAllreduce" in names:
        logical = tuple(layer._logical_shape)
        dim = int(layer.partition_dim)
        sub_sizes = tuple(layer._subparam_sizes or (logical[dim], ))
        widths = reader.sub_param_widths(sub_sizes)
        row = "SubParamLinearAllreduce" in names
        role = "sub_params" if len(sub_sizes) > 1 else None
        out["weight"] = TPLayout.sub_params(layer._orig_weight_shape,
                                            tp,
                                            dim,
                                            sub_sizes,
                                            widths,
                                            partition_type="row" if row else "column",
                                            view_shape=logical,
                                            role=role)
        if bias is not None:
            bias_dim = None if row else getattr(layer, "_bias_partition_dim", None)
            if bias_dim is None:
                out["bias"] = TPLayout.replicated(layer._orig_bias_shape, tp)
            else:
                out["bias"] = TPLayout.sub_params(layer._orig_bias_shape,
                                                  tp,
                                                  bias_dim,
                                                  sub_sizes,
                                                  widths,
                                                  view_shape=tuple(layer._output_shape),
                                                  role=role)
        return out

    if "GateUpPack_LinearLayer" in names and "SubParamColumnParallel" not in names:
        # DeepSpeed < 0.19: gate and up halves are cut alike, so each rank holds half its rows of each.
        for key, param in (("weight", weight), ("bias", bias)):
            if param is not None:
                local = _full_shape(param)
                halves = tuple(size // 2 for size in reader.gathered_sizes(local[0]))
                full = (2 * sum(halves), *local[1:])
                out[key] = TPLayout.sub_params(full, tp, 0, (sum(halves), ) * 2, (halves, halves), role="gate_up")
        return out

    if "fused_LinearLayer" in names and getattr(layer, "_subparam_layout_spec", None) is None:
        raise LayoutError(f"AutoTP layer {reader.name!r} is a fused QKV layer of a DeepSpeed release that does not "
                          "describe its split; give it an explicit partition_config spec with 'shape' instead")

    if "SubParamColumnParallel" in names:  # fused_LinearLayer (fused QKV), GateUpPack_LinearLayer
        sub_sizes, shard_name = getattr(layer, "_subparam_layout_spec", (None, None))
        if sub_sizes is None:
            raise LayoutError(f"AutoTP layer {reader.name!r} ({type(layer).__name__}) interleaves or replicates "
                              "blocks across TP ranks; its parameters cannot be reassembled")
        widths = reader.sub_param_widths(sub_sizes, shard_name)
        role = "gate_up" if "GateUpPack_LinearLayer" in names else "fused_qkv"
        for key, param in (("weight", weight), ("bias", bias)):
            if param is not None:
                shape = layer._orig_weight_shape if key == "weight" else layer._orig_bias_shape
                out[key] = TPLayout.sub_params(shape, tp, 0, sub_sizes, widths, role=role)
        return out

    full_weight = getattr(layer, "_orig_weight_shape", None)
    full_bias = getattr(layer, "_orig_bias_shape", None)

    if "VocabParallelEmbedding" in names:
        out["weight"] = reader.plain_split(weight, 0, full_weight, "column", role="vocab")
        return out

    if "HiddenParallelEmbedding" in names:
        out["weight"] = reader.plain_split(weight, 1, full_weight, "row", role="embedding_hidden")
        return out

    if names & {"Yuan_LinearLayer", "Yuan_LinearAllreduce", "conv_LinearLayer", "Conv_LinearALlreduce"}:
        return None  # layouts we do not describe ourselves; upstream's meta (if any) is used instead

    if "LinearAllreduce" in names:  # also LmHeadLinearAllreduce
        out["weight"] = reader.plain_split(weight, 1, full_weight, "row")
        if bias is not None:
            out["bias"] = TPLayout.replicated(_full_shape(bias), tp)
        return out

    if "LinearLayer" in names:  # also VocabParallelLinear
        is_vocab = "VocabParallelLinear" in names or str(reader.name).split(".")[-1] in ("lm_head", "embed_out")
        role = "vocab" if is_vocab else None
        out["weight"] = reader.plain_split(weight, 0, full_weight, "column", role=role)
        if bias is not None:
            out["bias"] = reader.plain_split(bias, 0, full_bias, "column", role=role)
        return out

    return None


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

    by_param: dict[int, TPLayout] = {}
    for module_name, module in model.named_modules():
        if "TensorParallel_Layer" not in _class_names(module):
            continue
        layer_tp = int(getattr(module, "tp_world_size", tp_size))
        grain = getattr(getattr(module, "tp_meta", None), "tp_grain_size", None) or tp_grain_size
        reader = _LayerReader(module, layer_tp, num_kv_heads, grain, use_layer_sizes)
        known = _layer_layouts(module, reader)
        for key in ("weight", "bias"):
            param = getattr(module, key, None)
            if not isinstance(param, torch.nn.Parameter):
                continue
            layout = (known or {}).get(key)
            if layout is None:
                meta = getattr(param, UPSTREAM_META_ATTR, None)
                if meta is None:
                    raise LayoutError(f"AutoTP layer {module_name!r} ({type(module).__name__}) has a layout "
                                      "deepspeed-ext cannot describe and DeepSpeed left no metadata for it")
                layout = layout_from_upstream_meta(meta, layer_tp)
            by_param[id(param)] = layout

    layouts: dict[str, TPLayout] = {}
    for name, param in model.named_parameters(remove_duplicate=True):
        layout = by_param.get(id(param)) or TPLayout.replicated(_full_shape(param), tp_size)
        local = _full_shape(param)
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
            local = _full_shape(param)
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
        layouts[name] = (TPLayout.replicated(_full_shape(param), tp_size)
                         if meta is None else layout_from_upstream_meta(meta, tp_size))
    return layouts


