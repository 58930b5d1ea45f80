"""DeepSpeed without ZeRO (stage 0): where each parameter's fp32 master and Adam moments live.

DeepSpeed runs a stage-0 optimizer through one of three wrappers, and each lays its state out differently:

* ``FP16_Optimizer`` (fp16/bf16 with a fused Adam): one flat fp32 master per param group, the group's
  parameters concatenated without padding; the torch optimizer's state is keyed by that flat master;
* ``FP16_UnfusedOptimizer`` (fp16/bf16 with any other optimizer): one fp32 master per parameter, and the
  torch state keyed by it;
* no wrapper (fp32): the torch optimizer steps the parameters themselves.

This module decodes those layouts as a checkpoint saved them (:class:`SavedStage0`, used by the checkpoint
reader). A live engine's are read by :mod:`deepspeed_ext.checkpoint.engine_private` (``live_slots``), under the
same wrapper names and the same key names (``deepspeed/keys.py``), so the two read one layout.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepspeed_ext.checkpoint.deepspeed import keys
from deepspeed_ext.checkpoint.deepspeed.files import indexed_state
from deepspeed_ext.errors import CheckpointError

FP16_OPTIMIZER = "FP16_Optimizer"
FP16_UNFUSED_OPTIMIZER = "FP16_UnfusedOptimizer"
TORCH_OPTIMIZER = "torch optimizer (no ZeRO)"


# --------------------------------------------------------------------------- a saved checkpoint
@dataclass
class SavedSlot:
    """Where one parameter's fp32 master and moments live in a saved stage-0 optimizer state."""

    key: int  # the entry in the torch optimizer's ``state`` (and in ``SavedStage0.masters``)
    start: int  # element offset inside that entry (non-zero only in FP16_Optimizer's flat groups)
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


NAMES_HINT = ("; the parameter order could not be recovered (several param groups or frozen parameters): save "
              "through deepspeed_ext.initialize, which records it in deepspeed_ext.json")


@dataclass
class SavedStage0:
    """The ``optimizer`` entry of one TP rank's model states, decoded.

    None of the wrappers names its parameters. The names come from deepspeed-ext's UC info when it recorded
    them, else from the module state dict's order (buffers and tied aliases dropped), which is the order
    ``module.parameters()`` hands the optimizer; every parameter's size is checked against the buffers.
    """

    kind: str
    base: dict[str, Any]  # the torch optimizer state dict (``state``, ``param_groups``)
    masters: dict[int, torch.Tensor]  # key -> 1-D fp32 master
    slots: OrderedDict[str, SavedSlot]

    @classmethod
    def read(cls, model_states: dict[str, Any], recorded: list[list[str]] | None, source: Path) -> SavedStage0:
        optimizer: dict[str, Any] = model_states[keys.OPTIMIZER]
        module: dict[str, Any] = model_states.get(keys.MODULE) or {}

        def shape(name: str) -> tuple[int, ...]:
            if name not in module:
                raise CheckpointError(f"{source}: optimizer parameter {name!r} is not in the module state dict")
            return tuple(module[name].shape)

        names = ([name for group in recorded for name in group] if recorded is not None else
                 param_names_of_module(module, model_states.get(keys.BUFFER_NAMES) or []))
        masters: dict[int, torch.Tensor] = {}
        slots: OrderedDict[str, SavedSlot] = OrderedDict()
        position = 0

        def take(count: int) -> list[str]:
            nonlocal position
            if position + count > len(names):
                raise CheckpointError(f"{source}: the optimizer holds more parameters than the module "
                                      f"({len(names)} named){NAMES_HINT}")
            position += count
            return names[position - count:position]

        base: Any
        if keys.FP32_GROUPS_FLAT in optimizer:
            kind, base = FP16_OPTIMIZER, optimizer.get(keys.WRAPPED_OPTIMIZER_STATE_DICT)
            for group, flat in enumerate(optimizer[keys.FP32_GROUPS_FLAT]):
                masters[group] = flat
                offset = 0
                while offset < flat.numel():
                    (name, ) = take(1)
                    slots[name] = SavedSlot(group, offset, shape(name))
                    offset += slots[name].numel
                if offset != flat.numel():
                    raise CheckpointError(f"{source}: flat fp32 group {group} has {flat.numel()} elements, but its "
                                          f"parameters add up to {offset}{NAMES_HINT}")
        elif keys.FP32_GROUPS in optimizer:
            kind, base = FP16_UNFUSED_OPTIMIZER, optimizer.get(keys.WRAPPED_OPTIMIZER_STATE_DICT)
            key = 0
            for tensors in optimizer[keys.FP32_GROUPS]:
                for name, master in zip(take(len(tensors)), tensors, strict=True):
                    masters[key] = master.reshape(-1)
                    slots[name] = SavedSlot(key, 0, tuple(master.shape))
                    key += 1
        elif keys.STATE in optimizer and keys.PARAM_GROUPS in optimizer:
            optimizer = indexed_state(optimizer, source)
            kind, base = TORCH_OPTIMIZER, optimizer
            # Before the first step (a save at step 0) no parameter has state, and every one is converted (its
            # master alone); after it, one without state was never stepped (frozen). An empty entry is no state.
            stepped = any(bool(state) for state in optimizer[keys.STATE].values())
            for group in optimizer[keys.PARAM_GROUPS]:
                for name, key in zip(take(len(group[keys.PARAMS])), group[keys.PARAMS], strict=True):
                    if stepped and not optimizer[keys.STATE].get(key):
                        continue  # frozen, or never stepped: nothing to convert (as ZeRO leaves it out)
                    slots[name] = SavedSlot(int(key), 0, shape(name))
                    masters[key] = module[name].reshape(-1)
        else:
            raise CheckpointError(f"{source}: unsupported optimizer state without ZeRO (keys: "
                                  f"{sorted(optimizer)[:8]})")
        if not isinstance(base, dict) or keys.STATE not in base:
            raise CheckpointError(f"{source}: {kind} state has no wrapped optimizer state dict")
        base = indexed_state(base, source)
        for name, slot in slots.items():
            master = masters[slot.key]
            if master.dtype != torch.float32:
                raise CheckpointError(f"{source}: fp32 master of {name!r} is {master.dtype}")
            if slot.start + slot.numel > master.numel() or (kind != FP16_OPTIMIZER and master.numel() != slot.numel):
                raise CheckpointError(f"{source}: {name!r} {slot.shape} does not fit its optimizer entry "
                                      f"{slot.key} ({master.numel()} elements){NAMES_HINT}")
        return cls(kind=kind, base=base, masters=masters, slots=slots)


def param_names_of_module(module: dict[str, Any], buffer_names: list[str]) -> list[str]:
    """Parameter names of a saved module state dict in registration order; tied aliases and buffers dropped.

    ``torch.load`` keeps tensors that shared storage at save time sharing it, which is how a tied
    ``lm_head.weight`` is recognised as the embedding it aliases.
    """
    buffers = set(buffer_names)
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    names = []
    for name, tensor in module.items():
        if name in buffers or not torch.is_tensor(tensor) or tensor.numel() == 0:
            continue  # an empty shard (a TP rank beyond the KV-head count) has no optimizer entry either
        identity = (tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()), tuple(tensor.shape))
        if identity in seen:
            continue
        seen.add(identity)
        names.append(name)
    return names
