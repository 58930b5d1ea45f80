"""The training side of a weight stream: the plan of a live engine (collective, once per engine), this rank's
values of each piece it sends (views of where it keeps them), and the source over the engine that
:func:`~deepspeed_ext.hf_weights` names (every rank receives each bucket's pieces from the ranks that hold them)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from deepspeed_ext.checkpoint import engine_private
from deepspeed_ext.checkpoint.live_module import adapters_of, model_class_of, model_config_of
from deepspeed_ext.checkpoint.model_config import persistent_buffers
from deepspeed_ext.errors import CheckpointError
from deepspeed_ext.module_inject.autotp import LAYOUT_ATTR, shard_rank, tag_autotp_model
from deepspeed_ext.module_inject.layout import TPLayout
from deepspeed_ext.weights.naming import StreamedSource, WeightOptions, named_tensors
from deepspeed_ext.weights.plan import Bucket, Holding, Landing, Piece, TensorPlan, WeightPlan, plan_from_holdings

#: Where an engine keeps its plan: the layouts do not change while it trains.
_PLAN_ATTR = "_deepspeed_ext_weight_plan"


def local_tensors(engine: Any) -> dict[str, tuple[torch.Tensor, int, int, torch.nn.Parameter | torch.Tensor]]:
    """name -> (what this rank keeps of it, flattened; where that starts in its shard; the shard; the tensor)."""
    if engine_private.engine_is_pipeline(engine):
        raise CheckpointError("weight streams serve AutoTP, ZeRO and AutoEP engines; a PipelineModule's layers have "
                              "no model (HF) names to stream under: convert a saved checkpoint instead")
    tp_size, tp_rank = engine_private.model_parallel_info(engine)
    module = engine.module
    params = list(module.named_parameters(remove_duplicate=True))
    if any(getattr(p, LAYOUT_ATTR, None) is None for _, p in params):
        tag_autotp_model(module, tp_size=tp_size, tp_rank=tp_rank)
    found: dict[str, tuple[torch.Tensor, int, int, torch.nn.Parameter | torch.Tensor]] = {}
    for name, param in params:
        layout: TPLayout = getattr(param, LAYOUT_ATTR)
        shard = 0 if layout.is_replicated else shard_rank(param, tp_rank)
        if not math.prod(layout.local_shape(shard)):
            continue  # a rank past the KV-head count: nothing of it here
        values, start = engine_private.held_weights(param)
        found[name] = (values, start, shard, param)
    for name, buffer in persistent_buffers(module).items():
        if name not in found:
            found[name] = (buffer.data.reshape(-1), 0, 0, buffer)
    return found


def engine_plan(engine: Any) -> WeightPlan:
    """Who sends what of ``engine``'s weights (collective over the engine's ranks the first time; kept after)."""
    plan: WeightPlan | None = getattr(engine, _PLAN_ATTR, None)
    if plan is not None:
        return plan
    import torch.distributed as dist
    module = engine.module
    local = local_tensors(engine)
    layouts: dict[str, TPLayout] = {}
    dtypes: dict[str, torch.dtype] = {}
    trainable: dict[str, bool] = {}
    for name, param in module.named_parameters(remove_duplicate=True):
        layouts[name] = getattr(param, LAYOUT_ATTR)
        dtypes[name] = local[name][0].dtype if name in local else param.dtype
        trainable[name] = bool(param.requires_grad)
    for name, buffer in persistent_buffers(module).items():
        if name not in layouts:
            layouts[name] = TPLayout.replicated(tuple(buffer.shape), 1)
            dtypes[name], trainable[name] = buffer.dtype, False
    mine = [Holding(name, shard, start, start + values.numel()) for name, (values, start, shard, _) in local.items()]
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    if ranks > 1:
        every: list[Any] = [None] * ranks
        dist.all_gather_object(every, mine)
    else:
        every = [mine]
    plan = WeightPlan(plan_from_holdings(layouts, dtypes, trainable, every), ranks, model_config_of(module),
                      model_class_of(module), adapters_of(module))
    setattr(engine, _PLAN_ATTR, plan)
    return plan


def own_values(local: Mapping[str, tuple[torch.Tensor, int, int, Any]], plan: TensorPlan,
               piece: Piece) -> torch.Tensor:
    """This rank's values of ``piece`` (which it owns), where it keeps them: a view, no copy."""
    values, start, shard, _ = local[plan.name]
    assert shard == piece.shard, f"{plan.name}: plan says shard {piece.shard}, this rank holds {shard}"
    return values[piece.start - start:piece.stop - start]


def buffer_device(engine: Any) -> torch.device:
    """Where a bucket's buffers live: beside the weights (an accelerator's memory under NCCL)."""
    for param in engine.module.parameters():
        device: torch.device = param.device
        return device
    return torch.device("cpu")


def gathered_buckets(engine: Any, plan: WeightPlan, buckets: list[Bucket]) -> Iterator[dict[str, torch.Tensor]]:
    """Each bucket's full tensors on every rank of the engine: each piece broadcast by its owner, the next bucket's
    posted before this one's are handed out."""
    import torch.distributed as dist
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = buffer_device(engine)
    local = local_tensors(engine)

    def post(owner: int, tensor: torch.Tensor) -> Any:
        return dist.broadcast(tensor, src=owner, async_op=True) if plan.ranks > 1 else None

    def own(tensor_plan: TensorPlan, piece: Piece) -> torch.Tensor | None:
        return own_values(local, tensor_plan, piece) if piece.owner == rank else None

    def fresh(tensor_plan: TensorPlan) -> torch.Tensor:
        return torch.empty(tensor_plan.layout.shape, dtype=tensor_plan.dtype, device=device)

    landing = None
    for bucket in buckets:
        following = Landing(bucket, fresh, post, own)
        if landing is not None:
            yield landing.finish()
        landing = following
    if landing is not None:
        yield landing.finish()


def hf_weights(engine: Any, options: WeightOptions, bucket_bytes: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The engine's full weights as ``options`` name them, on every rank (see :func:`deepspeed_ext.hf_weights`)."""
    plan = engine_plan(engine)
    if options.adapters == "only" and options.names != "module":
        plan = adapters_plan(plan)
    source = StreamedSource(plan, gathered_buckets(engine, plan, plan.buckets(bucket_bytes)),
                            "live engine")
    yield from named_tensors(source, options)
    source.drain()


def adapters_plan(plan: WeightPlan) -> WeightPlan:
    """The part of ``plan`` that is a peft model's adapters (their LoRA factors); one line where it has none. Kept
    with the plan, so its buckets are worked out once too."""
    from deepspeed_ext.checkpoint.adapters import is_lora_factor
    adapters = plan.adapters_only
    if adapters is None:
        adapters = plan.adapters_only = plan.only(name for name in plan.by_name
                                                  if is_lora_factor(name) or ".lora_" in name)
    if not adapters.tensors:
        raise CheckpointError("adapters only: the engine's model has no peft LoRA adapters")
    return adapters
