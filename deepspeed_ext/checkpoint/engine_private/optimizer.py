"""Where a live optimizer keeps each parameter's state: the stage-0 wrappers' slots, ZeRO-1/2 fragments, Muon's
whole-parameter momentum, the step counts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from deepspeed_ext.checkpoint.deepspeed import keys
from deepspeed_ext.checkpoint.deepspeed.zero0 import FP16_OPTIMIZER, FP16_UNFUSED_OPTIMIZER, TORCH_OPTIMIZER
from deepspeed_ext.checkpoint.engine_private.engine import (
    is_zero3_param,
    partitions_weights,
    uses_zero,
    zero3_partition,
)
from deepspeed_ext.checkpoint.states import MASTER_WEIGHTS, MUON_MOMENTUM, USE_MUON


# --------------------------------------------------------------------------- stage 0: the three wrappers
@dataclass
class LiveSlot:
    """Where one parameter's fp32 master and moments live in a running stage-0 optimizer."""

    master: torch.Tensor  # 1-D fp32 tensor holding the master at [start, start + numel)
    key: torch.Tensor  # the wrapped torch optimizer's state key (the flat group, the fp32 master or the param)
    start: int
    numel: int

    def master_of(self) -> torch.Tensor:
        return self.master.narrow(0, self.start, self.numel)

    def moment_of(self, torch_optimizer: torch.optim.Optimizer, state: str) -> torch.Tensor:
        # ``get``: a look-up must not add an empty entry to the optimizer's state (a defaultdict), which a save
        # would then write for a parameter that has not stepped
        moment: torch.Tensor = torch_optimizer.state.get(self.key, {})[state]
        return moment.view(-1).narrow(0, self.start, self.numel)


def wrapped_optimizer(optimizer: Any) -> Any:
    """The torch optimizer a wrapper steps (a bare torch optimizer is its own)."""
    return getattr(optimizer, "optimizer", optimizer)


def base_optimizer(engine: Any) -> Any:
    """The torch optimizer the engine's optimizer (a ZeRO or FP16 wrapper, or none) steps; None without one."""
    optimizer = getattr(engine, "optimizer", None)
    return wrapped_optimizer(optimizer) if optimizer is not None else None


def live_kind(optimizer: Any) -> str:
    if hasattr(optimizer, keys.FP32_GROUPS_FLAT):
        return FP16_OPTIMIZER
    if hasattr(optimizer, keys.FP32_GROUPS):
        return FP16_UNFUSED_OPTIMIZER
    return TORCH_OPTIMIZER


def live_param_groups(optimizer: Any) -> list[list[torch.nn.Parameter]]:
    """The model's parameters per param group, in the order the optimizer holds (and saves) their state.

    The FP16 wrappers keep them in ``fp16_groups`` (their ``param_groups`` hold the fp32 masters instead).
    """
    if live_kind(optimizer) == TORCH_OPTIMIZER:
        return [list(group[keys.PARAMS]) for group in optimizer.param_groups]
    return [list(group) for group in optimizer.fp16_groups]


def live_slots(optimizer: Any) -> dict[torch.nn.Parameter, LiveSlot]:
    """Each optimizer parameter's slot in a running stage-0 optimizer."""
    slots: dict[torch.nn.Parameter, LiveSlot] = {}
    kind = live_kind(optimizer)
    if kind == FP16_OPTIMIZER:
        for params, flat in zip(optimizer.fp16_groups, optimizer.fp32_groups_flat, strict=True):
            offset = 0
            for param in params:
                slots[param] = LiveSlot(flat.data, flat, offset, param.numel())
                offset += param.numel()
    elif kind == FP16_UNFUSED_OPTIMIZER:
        for params, masters in zip(optimizer.fp16_groups, optimizer.fp32_groups, strict=True):
            for param, master in zip(params, masters, strict=True):
                slots[param] = LiveSlot(master.data.view(-1), master, 0, master.numel())
    else:
        for params in live_param_groups(optimizer):
            for param in params:
                slots[param] = LiveSlot(param.data.view(-1), param, 0, param.numel())
    return slots


def stage0_slots(engine: Any) -> dict[torch.nn.Parameter, LiveSlot]:
    """Each parameter's slot in DeepSpeed's stage-0 optimizer (empty under ZeRO, or without an optimizer)."""
    if getattr(engine, "optimizer", None) is None or uses_zero(engine):
        return {}
    return live_slots(engine.optimizer)


def stage0_param_names(engine: Any) -> list[list[str]] | None:
    """Parameter names per optimizer param group, in the optimizer's order, for engines without ZeRO (None
    otherwise). DeepSpeed's stage-0 optimizer state is keyed by position only; ZeRO states name their
    parameters."""
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is None or uses_zero(engine):
        return None
    names = {id(param): name for name, param in engine.module.named_parameters()}
    return [[names[id(param)] for param in group] for group in live_param_groups(optimizer)]


# --------------------------------------------------------------------------- where a state lives
def muon_whole_offsets(engine: Any) -> dict[torch.nn.Parameter, tuple[int, int]]:
    """ZeRO-1/2 under DeepSpeed's Muon (optimizer not offloaded): ``(param group, offset)`` of each parameter with
    elements in this rank's partition of a Muon group, in that group's momentum, which holds those parameters
    *whole*, one after another in partition order (Newton-Schulz needs whole matrices; a matrix split between two
    partitions has its momentum on both ranks). Empty for every other engine and optimizer."""
    optimizer = getattr(engine, "optimizer", None)
    partitions = getattr(optimizer, "params_in_partition", None)
    base = base_optimizer(engine)
    if (partitions is None or partitions_weights(engine) or getattr(optimizer, "cpu_offload", False)
            or "muon" not in type(base).__name__.lower()):
        return {}
    found: dict[torch.nn.Parameter, tuple[int, int]] = {}
    for group, params in enumerate(partitions):
        if not params or not base.param_groups[group].get(USE_MUON):
            continue
        offset = 0
        for param in params:
            found[param] = (group, offset)
            offset += param.numel()
    return found


def _whole_state(base: Any, group: int, state: str) -> torch.Tensor | None:
    flat = base.param_groups[group][keys.PARAMS][0]
    value: torch.Tensor | None = base.state.get(flat, {}).get(state)
    return value


def state_targets(param: torch.nn.Parameter, state: str | None, engine: Any,
                  stage0: Mapping[torch.nn.Parameter, LiveSlot],
                  whole: Mapping[torch.nn.Parameter, tuple[int, int]] | None = None
                  ) -> list[tuple[torch.Tensor, int]] | None:
    """Where this rank keeps ``state`` (None: the fp32 master) of a ZeRO-0/1/2 parameter: ``(1-D tensor, start)``
    pairs, each holding elements ``[start, start + numel)`` of the TP-local parameter flattened; None if no
    optimizer manages the parameter. ``whole``: :func:`muon_whole_offsets`, where Muon's momentum holds the whole
    parameter.

    ZeRO gives every optimizer parameter an ``_hp_mapping``; it is None where the parameter lies wholly in
    another DP rank's partition, and then this rank keeps nothing of it.
    """
    slot = stage0.get(param)
    if slot is not None:
        return [(slot.master_of() if state is None else slot.moment_of(base_optimizer(engine), state), 0)]
    if not hasattr(param, "_hp_mapping"):
        return None
    mapping = param._hp_mapping
    if mapping is None:
        return []
    if state == MUON_MOMENTUM and whole and param in whole:
        group, offset = whole[param]
        momentum = _whole_state(base_optimizer(engine), group, state)
        if momentum is not None:
            return [(momentum.narrow(0, offset, param.numel()), 0)]
    return [(mapping.get_hp_fragment(state), int(mapping.lp_fragment_address.start))]


def owned_state(param: Any, state: str, stage0: Mapping[Any, LiveSlot], base: Any,
                dp_rank: int, whole: Mapping[Any, tuple[int, int]] | None = None) -> torch.Tensor | None:
    """The part of ``param``'s ``state`` this rank owns: its ZeRO partition, the whole tensor on DP rank 0
    without ZeRO, or None (another rank's, or the state does not exist yet). ``whole``:
    :func:`muon_whole_offsets` (a rank owns the part of a whole-parameter momentum its partition holds)."""
    master = state == MASTER_WEIGHTS
    slot = stage0.get(param)
    if slot is not None:
        if dp_rank != 0:
            return None
        try:
            held: torch.Tensor = slot.master_of() if master else slot.moment_of(base, state)
        except KeyError:
            return None
        return held
    if is_zero3_param(param):  # the flat partition is padded to equal sizes; keep the real part
        try:
            local: torch.Tensor | None = param._z3_optimizer.get_local_fp32_param(param, None if master else state)
        except KeyError:
            return None
        if local is None:
            return None
        start, stop, _ = zero3_partition(param)
        return local.reshape(-1)[:stop - start]
    mapping = getattr(param, "_hp_mapping", None)
    if mapping is None:
        return None
    if master:
        fragment: torch.Tensor = mapping.get_hp_fragment()
        return fragment
    # DeepSpeed links the moment fragments lazily (at the next step after a load): read them from the flat
    # partition's state, where the fragment sits at the same address as the master's.
    moment = _whole_state(base, mapping.param_group_index, state)
    if moment is None:
        return None
    if state == MUON_MOMENTUM and whole and param in whole:
        _, offset = whole[param]
        start = offset + int(mapping.lp_fragment_address.start)
        return moment.narrow(0, start, int(mapping.lp_fragment_address.numel))
    address = mapping.hp_fragment_address
    narrowed: torch.Tensor = moment.narrow(0, address.start, address.numel)
    return narrowed


def live_steps(engine: Any) -> tuple[int, int, int]:
    """(the lowest and the highest step of the optimizer's states, the engine's step counter); -1 where there
    is none."""
    base = base_optimizer(engine)
    steps = set()
    for state in (base.state.values() if base is not None else ()):
        step = state.get("step") if isinstance(state, Mapping) else None
        if step is not None:
            steps.add(int(step.item()) if torch.is_tensor(step) else int(step))
    low, high = (min(steps), max(steps)) if steps else (-1, -1)
    return low, high, int(getattr(engine, "global_steps", -1))
