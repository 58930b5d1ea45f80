"""DeepSpeed AutoTP's layers, fenced: what each layer class keeps of how it cut its weight (its full shape, the
shard sizes it froze, sub-parameter widths, the bias's split), read into a
:class:`~deepspeed_ext.module_inject.layout.TPLayout` per parameter.

These are the layers' private attributes and class names, which DeepSpeed renames between releases; the classes
this module dispatches on are in the up-front check (:mod:`.check`), and an attribute a layer lacks is named in
one line (:func:`_part`) instead of an AttributeError inside a save.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from deepspeed_ext.checkpoint.engine_private.engine import stored_shape
from deepspeed_ext.errors import DeepSpeedExtError, LayoutError
from deepspeed_ext.module_inject.layout import TPLayout, shard_sizes

#: Attribute DeepSpeed (>= 0.18.9) attaches to AutoTP parameters: its own record of their split.
UPSTREAM_META_ATTR = "ds_autotp_universal_checkpoint_meta"
#: The base class of every AutoTP layer (``deepspeed.module_inject.layers``).
TENSOR_PARALLEL_LAYER = "TensorParallel_Layer"


def _part(layer: torch.nn.Module, attribute: str) -> Any:
    """``layer``'s ``attribute``, which its class sets when it cuts the weight; one line where it does not."""
    try:
        return getattr(layer, attribute)
    except AttributeError:
        import deepspeed
        raise DeepSpeedExtError(
            f"DeepSpeed {deepspeed.__version__}'s AutoTP layer {type(layer).__name__} has no {attribute}, which "
            "deepspeed-ext reads to describe its split (see 'Adding a DeepSpeed release' in docs/architecture.md)"
        ) from None


def autotp_layers(model: torch.nn.Module, tp_size: int, tp_grain_size: int
                  ) -> Iterator[tuple[str, torch.nn.Module, int, int]]:
    """``(name, layer, its TP degree, its grain)`` of every AutoTP layer of ``model``."""
    for module_name, module in model.named_modules():
        if TENSOR_PARALLEL_LAYER not in _class_names(module):
            continue
        layer_tp = int(getattr(module, "tp_world_size", tp_size))
        grain = getattr(getattr(module, "tp_meta", None), "tp_grain_size", None) or tp_grain_size
        yield module_name, module, layer_tp, int(grain)


def _class_names(module: torch.nn.Module) -> set[str]:
    return {cls.__name__ for cls in type(module).__mro__}




class LayerReader:
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
            local = stored_shape(param)
            sizes = self.gathered_sizes(local[dim])
            full_shape = list(local)
            full_shape[dim] = sum(sizes)
        return TPLayout.split(tuple(full_shape), self.tp_size, dim, sizes, partition_type, role=role)

    def sub_param_widths(self, sub_sizes: Sequence[int], name: str | None = None) -> tuple[tuple[int, ...], ...]:
        frozen = getattr(self.layer, "_subparam_shard_widths", None) if self.use_layer_sizes else None
        if frozen is not None:
            return tuple(tuple(w) for w in frozen)
        return tuple(self.rule(size, name) for size in sub_sizes)


def layer_layouts(layer: torch.nn.Module, reader: LayerReader) -> dict[str, TPLayout] | None:
    """Layouts of a known AutoTP layer's direct parameters, keyed ``weight``/``bias``; None if unknown."""
    names = _class_names(layer)
    tp = reader.tp_size
    weight: Any = getattr(layer, "weight", None)
    bias: Any = getattr(layer, "bias", None)
    out: dict[str, TPLayout] = {}

    if "SubParamLinearLayer" in names or "SubParamLinearAllreduce" in names:
        logical = tuple(_part(layer, "_logical_shape"))
        dim = int(_part(layer, "partition_dim"))
        sub_sizes = tuple(_part(layer, "_subparam_sizes") or (logical[dim], ))
        widths = reader.sub_param_widths(sub_sizes)
        row = "SubParamLinearAllreduce" in names
        role = "sub_params" if len(sub_sizes) > 1 else None
        out["weight"] = TPLayout.sub_params(_part(layer, "_orig_weight_shape"),
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
                out["bias"] = TPLayout.replicated(_part(layer, "_orig_bias_shape"), tp)
            else:
                out["bias"] = TPLayout.sub_params(_part(layer, "_orig_bias_shape"),
                                                  tp,
                                                  bias_dim,
                                                  sub_sizes,
                                                  widths,
                                                  view_shape=tuple(_part(layer, "_output_shape")),
                                                  role=role)
        return out

    if "GateUpPack_LinearLayer" in names and "SubParamColumnParallel" not in names:
        # DeepSpeed < 0.19: gate and up halves are cut alike, so each rank holds half its rows of each.
        for key, param in (("weight", weight), ("bias", bias)):
            if param is not None:
                local = stored_shape(param)
                halves = tuple(size // 2 for size in reader.gathered_sizes(local[0]))
                full = (2 * sum(halves), *local[1:])
                out[key] = TPLayout.sub_params(full, tp, 0, (sum(halves), ) * 2, (halves, halves), role="gate_up")
        return out

    if "fused_LinearLayer" in names and getattr(layer, "_subparam_layout_spec", None) is None:
        raise LayoutError(f"AutoTP layer {reader.name!r} is a fused QKV layer of a DeepSpeed release that does not "
                          "describe its split; give it an explicit partition_config spec with 'shape' instead")

    if "SubParamColumnParallel" in names:  # fused_LinearLayer (fused QKV), GateUpPack_LinearLayer
        spec: Any = getattr(layer, "_subparam_layout_spec", (None, None))
        sub_sizes, shard_name = spec
        if sub_sizes is None:
            raise LayoutError(f"AutoTP layer {reader.name!r} ({type(layer).__name__}) interleaves or replicates "
                              "blocks across TP ranks; its parameters cannot be reassembled")
        widths = reader.sub_param_widths(sub_sizes, shard_name)
        role = "gate_up" if "GateUpPack_LinearLayer" in names else "fused_qkv"
        for key, param in (("weight", weight), ("bias", bias)):
            if param is not None:
                shape = _part(layer, "_orig_weight_shape") if key == "weight" else _part(layer, "_orig_bias_shape")
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
            out["bias"] = TPLayout.replicated(stored_shape(bias), tp)
        return out

    if "LinearLayer" in names:  # also VocabParallelLinear
        is_vocab = "VocabParallelLinear" in names or str(reader.name).split(".")[-1] in ("lm_head", "embed_out")
        role = "vocab" if is_vocab else None
        out["weight"] = reader.plain_split(weight, 0, full_weight, "column", role=role)
        if bias is not None:
            out["bias"] = reader.plain_split(bias, 0, full_bias, "column", role=role)
        return out

    return None


#: How a LoRA adapter pairs with each AutoTP layer it may sit on, by the layer's inputs and outputs: ``column`` (whole
#: input, output split: lora_B is cut as the weight's rows), ``row`` (input split, output summed: lora_A is cut as the
#: weight's columns), ``whole`` (whole input and whole output: the adapter stays whole). Most derived class first.
_ADAPTER_SPLITS = (
    ("LinearAllreduceWithReplicatedInput", "whole"),
    ("LmHeadLinearAllreduce", None),  # an inference head; not trained
    ("SubParamLinearAllreduce", "row"),
    ("Yuan_LinearAllreduce", None),  # head groups cut apart, not columns in a row
    ("Conv_LinearALlreduce", None),
    ("LinearAllreduce", "row"),
    ("SubParamLinearLayer", "column"),
    ("VocabParallelLinear", "column"),
    ("SubParamColumnParallel", "column"),  # fused QKV, GateUpPack
    ("conv_LinearLayer", None),
    ("Yuan_LinearLayer", None),
    ("LinearLayer", "column"),
)


def adapter_split(layer: torch.nn.Module) -> str | None:
    """How a LoRA adapter over ``layer`` is split (see ``_ADAPTER_SPLITS``); None for a layer no adapter can pair with.
    A column layer that gathers its output (``gather_output``) gives a whole output, so its adapter stays whole."""
    names = _class_names(layer)
    for class_name, split in _ADAPTER_SPLITS:
        if class_name in names:
            if split == "column" and getattr(layer, "gather_output", False):
                return "whole"
            return split
    return None


def mark_tensor_parallel(param: torch.nn.Parameter) -> None:
    """Tell DeepSpeed ``param`` is one TP rank's shard: its gradient norm then sums every rank's part (a replicated
    parameter counts once), as for AutoTP's own weights."""
    from deepspeed.module_inject.layers import DS_TENSOR_MODEL_PARALLEL
    setattr(param, DS_TENSOR_MODEL_PARALLEL, True)


def is_autotp_layer(module: torch.nn.Module) -> bool:
    return TENSOR_PARALLEL_LAYER in _class_names(module)


def autotp_param_layouts(model: torch.nn.Module, tp_size: int, num_kv_heads: int | None, tp_grain_size: int = 1,
                         use_layer_sizes: bool = True) -> dict[int, TPLayout]:
    """``{id(param): layout}`` of every parameter of every AutoTP layer of ``model``: read from the layer's structure
    (:func:`layer_layouts`), else from DeepSpeed's own per-parameter metadata; one line for a layer with neither."""
    from deepspeed_ext.module_inject.upstream import layout_from_upstream_meta
    by_param: dict[int, TPLayout] = {}
    for module_name, module, layer_tp, grain in autotp_layers(model, tp_size, tp_grain_size):
        known = layer_layouts(module, LayerReader(module, layer_tp, num_kv_heads, grain, use_layer_sizes))
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
    return by_param
