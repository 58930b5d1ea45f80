"""The moment inside ``deepspeed.initialize`` when AutoTP shards the model, fenced: deepspeed-ext runs its own steps
just before and just after it (``DeepSpeedEngine._configure_tensor_parallel``), while the engine has its TP groups
but no optimizer yet, so parameters cut there are what ZeRO and the optimizer are built from.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

#: ``before(model) -> state`` runs as AutoTP starts; ``after(model, state, sharded)`` once it ends (``sharded``: False
#: when AutoTP raised, so ``after`` only undoes what ``before`` did).
Before = Callable[[torch.nn.Module], Any]
After = Callable[[torch.nn.Module, Any, bool], None]


@contextlib.contextmanager
def around_autotp(before: Before, after: After) -> Iterator[None]:
    """Within the block, every engine built runs ``before`` / ``after`` around AutoTP's sharding of its model (an
    engine whose autotp_size is 1 never shards, so neither runs)."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    original = DeepSpeedEngine._configure_tensor_parallel

    def configure_tensor_parallel(engine: Any, model: torch.nn.Module, tp_config: Any) -> Any:
        if getattr(model, "ds_autotp_parsed", False):  # sharded by an engine before (the Trainer's second): as it is
            return original(engine, model, tp_config)
        state = before(model)
        try:
            with _frozen_without_grad_hooks(model):
                result = original(engine, model, tp_config)
        except BaseException:
            after(model, state, False)
            raise
        after(model, state, True)
        _refresh_upstream_info(model)
        return result

    DeepSpeedEngine._configure_tensor_parallel = configure_tensor_parallel
    try:
        yield
    finally:
        DeepSpeedEngine._configure_tensor_parallel = original


#: The mark AutoTP (0.19) sets on a parameter it gave a gradient all-reduce hook, and skips one that has it.
_GRAD_HOOK_MARK = "_ds_grad_allreduce_registered"


@contextlib.contextmanager
def _frozen_without_grad_hooks(model: torch.nn.Module) -> Iterator[None]:
    """AutoTP gives the replicated parameters a partition_config marks ``grad_allreduce`` (Qwen3's q/k norms) a
    gradient hook, which torch refuses on a frozen parameter (a LoRA model's base): the run fails at initialize.
    A frozen parameter has no gradient to sum, so it passes as already hooked, and the mark goes once AutoTP ends."""
    marked = [param for param in model.parameters()
              if not param.requires_grad and not getattr(param, _GRAD_HOOK_MARK, False)]
    for param in marked:
        setattr(param, _GRAD_HOOK_MARK, True)
    try:
        yield
    finally:
        for param in marked:
            delattr(param, _GRAD_HOOK_MARK)


def _refresh_upstream_info(model: torch.nn.Module) -> None:
    """DeepSpeed's own model-level UC record, taken again from the model as ``after`` left it (its parameter names
    are those the checkpoints hold), where AutoTP recorded one (DeepSpeed >= 0.18.9)."""
    import deepspeed.module_inject.layers as layers
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
    collect = getattr(layers, "collect_autotp_universal_checkpoint_info", None)
    if collect is not None and getattr(model, UNIVERSAL_CHECKPOINT_INFO, None) is not None:
        setattr(model, UNIVERSAL_CHECKPOINT_INFO, collect(model))


def tp_process_group() -> Any:
    """DeepSpeed's tensor-parallel process group of this rank (a ``torch.distributed`` group)."""
    from deepspeed.utils import groups
    return groups.get_tensor_model_parallel_group()


def collective_device(group: Any, device: torch.device) -> torch.device:
    """Where a tensor on ``device`` goes for a collective over ``group``: where it is for gloo, else the
    accelerator's current device (NCCL and its kin take no host tensors)."""
    import torch.distributed as dist
    if dist.get_backend(group) == "gloo":
        return device
    from deepspeed.accelerator import get_accelerator
    return torch.device(get_accelerator().current_device_name())
