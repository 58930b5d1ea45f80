"""Sink: load a universal checkpoint, or a regular DeepSpeed checkpoint, into a live engine at any TP/DP degree.

Each rank asks the checkpoint for its TP slice under the *target* model's :class:`TPLayout` (computed by
the live AutoTP layers). A universal checkpoint cuts it from the full tensor; a DeepSpeed checkpoint
assembles it from the overlapping pieces of the saved TP slices and ZeRO partitions (load-time resharding, no
conversion step). DeepSpeed's fragment API then keeps only this DP rank's part; a ZeRO-3 rank asks for its DP
partition of the slice only. Both sources read those ranges with ``pread``, readahead off (:mod:`.ranges`), so
a rank reads the pages of its own ranges, not whole tensors and not its neighbours' pages.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Protocol

import torch

from deepspeed_ext.checkpoint.deepspeed import keys, zero0
from deepspeed_ext.checkpoint.source import ADAM_STATES, MASTER_WEIGHTS
from deepspeed_ext.checkpoint.tensor import persistent_buffers
from deepspeed_ext.checkpoint.universal import UniversalCheckpoint
from deepspeed_ext.errors import CheckpointError
from deepspeed_ext.module_inject.autotp import LAYOUT_ATTR, tag_autotp_model, tp_group_info
from deepspeed_ext.module_inject.layout import TPLayout


def _base_optimizer(engine: Any) -> Any:
    return zero0.wrapped_optimizer(engine.optimizer)


def _stage0_slots(engine: Any) -> dict[torch.nn.Parameter, zero0.LiveSlot]:
    """Each parameter's slot in DeepSpeed's stage-0 optimizer (empty under ZeRO)."""
    if engine.optimizer is None or engine.zero_optimization():
        return {}
    return zero0.live_slots(engine.optimizer)


def _state_targets(param: torch.nn.Parameter, state: str | None, engine: Any,
                   stage0: dict[torch.nn.Parameter, zero0.LiveSlot]) -> list[tuple[torch.Tensor, int]] | None:
    """Where this rank keeps ``state`` (None: the fp32 master) of a ZeRO-0/1/2 parameter: ``(1-D tensor, start)``
    pairs, each holding elements ``[start, start + numel)`` of the TP-local parameter flattened; None if no
    optimizer manages the parameter.

    ZeRO gives every optimizer parameter an ``_hp_mapping``; it is None where the parameter lies wholly in
    another DP rank's partition, and then this rank keeps nothing of it.
    """
    slot = stage0.get(param)
    if slot is not None:
        return [(slot.master_of() if state is None else slot.moment_of(_base_optimizer(engine), state), 0)]
    if not hasattr(param, "_hp_mapping"):
        return None
    mapping = param._hp_mapping
    if mapping is None:
        return []
    return [(mapping.get_hp_fragment(state), int(mapping.lp_fragment_address.start))]


def _fill(targets: list[tuple[torch.Tensor, int]], ckpt: ReshardingSource, name: str, state: str, layout: TPLayout,
          tp_rank: int) -> None:
    """Copy into each ``(tensor, start)`` of ``targets`` its elements of the TP-local tensor, reading the range
    they span once, block by block: memory stays at a block whatever the tensor's size, and a DP rank reads
    only the part of its TP slice it keeps."""
    from deepspeed_ext.checkpoint.tensor import BLOCK_ELEMENTS
    spans = [(tensor.view(-1), start, start + tensor.numel()) for tensor, start in targets if tensor.numel()]
    if not spans:
        return
    low, high = min(start for _, start, _ in spans), max(stop for _, _, stop in spans)
    row = math.prod(layout.local_shape(tp_rank)[1:]) or 1
    step = max(1, BLOCK_ELEMENTS // row) * row
    position = low
    while position < high:
        stop = min(high, (position // step + 1) * step)  # block boundaries on whole rows
        block = ckpt.resharded_range(name, state, layout, tp_rank, position, stop)
        for flat, first, last in spans:
            a, b = max(position, first), min(stop, last)
            if a < b:
                flat[a - first:b - first].copy_(block[a - position:b - position])
        position = stop


def zero3_partition(param: Any) -> tuple[int, int, int]:
    """This rank's ZeRO-3 partition of ``param``: ``(start, stop)`` of the elements it holds in the parameter
    flattened, and the partition's size. Every rank's partition has that size; the last ones are padded past
    the parameter's end, so ``stop - start`` may be smaller, even 0."""
    import torch.distributed as dist
    size, numel = int(param.ds_tensor.ds_numel), int(param.ds_numel)
    start = min(dist.get_rank(group=param.ds_process_group) * size, numel)
    return start, min(start + size, numel), size


def _set_zero3_partition(param: Any, ckpt: ReshardingSource, name: str, state: str, layout: TPLayout,
                         tp_rank: int) -> None:
    """Restore ``state`` of a ZeRO-3 parameter from the elements of its TP slice that this DP rank keeps:
    the rank reads its own partition, not the slice."""
    from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state
    local_numel = math.prod(layout.local_shape(tp_rank))
    if int(param.ds_numel) != local_numel:
        raise CheckpointError(f"{ckpt.path}: {name!r} holds {int(param.ds_numel)} elements on TP rank {tp_rank}, "
                              f"its TP layout {local_numel}")
    start, stop, size = zero3_partition(param)
    partition = _zero3_partition_in_place(param, state, size)
    if partition is not None:  # written block by block: no copy of the partition, whatever its size
        _fill([(partition[:stop - start], start)], ckpt, name, state, layout, tp_rank)
        partition[stop - start:].zero_()  # the padding past the parameter's end, as DeepSpeed keeps it
        return
    value = torch.zeros(size, dtype=torch.float32)  # the padding past the parameter's end stays 0
    value[:stop - start].copy_(ckpt.resharded_range(name, state, layout, tp_rank, start, stop))
    if state == MASTER_WEIGHTS:
        safe_set_local_fp32_param(param, value)
    else:
        safe_set_local_optimizer_state(param, value, state)


def _zero3_partition_in_place(param: Any, state: str, size: int) -> torch.Tensor | None:
    """The ZeRO-3 optimizer's own fp32 partition of ``state`` for ``param`` (a view of its flat sub-group
    buffer), to restore in place; ``None`` where it is not simply there: optimizer states swapped to NVMe,
    or a DeepSpeed whose internals differ. DeepSpeed's public setter takes the whole partition as one tensor,
    a transient copy as large as the partition (the whole TP slice at DP=1); writing into the buffer block
    by block keeps the restore's memory at a block."""
    optimizer = getattr(param, "_z3_optimizer", None)
    partition_of = getattr(optimizer, "_get_fp32_opt_state_partition", None)
    if partition_of is None or getattr(optimizer, "swap_optimizer", True):
        return None
    key = None if state == MASTER_WEIGHTS else state
    try:
        partition, _ = partition_of(param, release_swap_buffers=False, optim_state_key=key)
    except (AttributeError, KeyError, TypeError):
        return None
    if not isinstance(partition, torch.Tensor) or partition.numel() != size or not partition.is_contiguous():
        return None
    return partition


class ReshardingSource(Protocol):
    """What the restore needs from a checkpoint: each parameter's shard at the live TP layout."""

    @property
    def path(self) -> Path: ...

    @property
    def names(self) -> list[str]: ...

    @property
    def has_optimizer_states(self) -> bool: ...

    @property
    def model_states(self) -> dict[str, Any]: ...

    def has(self, name: str, state: str) -> bool: ...

    def resharded(self, name: str, state: str, target: TPLayout, rank: int) -> torch.Tensor: ...

    def resharded_range(self, name: str, state: str, target: TPLayout, rank: int, low: int,
                        high: int) -> torch.Tensor: ...

    def step(self, name: str) -> torch.Tensor | int | None: ...

    def optimizer_state_for_universal(self) -> dict[str, Any]: ...


def load_universal_checkpoint(engine: Any,
                              load_dir: str | Path,
                              tag: str | None = None,
                              **options: bool) -> tuple[str, dict[str, Any]]:
    """Restore ``engine`` from a universal checkpoint; returns ``(load_path, client_state)`` like DeepSpeed.

    Options: ``load_optimizer_states``, ``load_lr_scheduler_states``, ``load_module_only`` (as DeepSpeed's).
    """
    return load_resharded(engine, UniversalCheckpoint(load_dir, tag), **options)


def load_deepspeed_checkpoint(engine: Any,
                              load_dir: str | Path,
                              tag: str | None = None,
                              **options: bool) -> tuple[str, dict[str, Any]]:
    """Restore ``engine`` directly from a regular DeepSpeed checkpoint saved at another TP/DP degree (or
    ZeRO stage), with no conversion step: each rank reads only the byte ranges of its own shards."""
    from deepspeed_ext.checkpoint.deepspeed import DeepSpeedCheckpoint
    return load_resharded(engine, DeepSpeedCheckpoint(load_dir, tag), **options)


def load_resharded(engine: Any,
                   ckpt: ReshardingSource,
                   *,
                   load_optimizer_states: bool = True,
                   load_lr_scheduler_states: bool = True,
                   load_module_only: bool = False) -> tuple[str, dict[str, Any]]:
    """Restore ``engine`` from ``ckpt`` at the engine's own TP/DP degrees."""
    tp_size, tp_rank = tp_group_info()
    module = engine.module
    params = list(module.named_parameters())
    if any(getattr(p, LAYOUT_ATTR, None) is None for _, p in params):
        tag_autotp_model(module, tp_size=tp_size, tp_rank=tp_rank)

    available = set(ckpt.names)
    missing = [name for name, p in params if p.requires_grad and name not in available]
    if missing:
        raise CheckpointError(f"{ckpt.path}: no saved tensors for {len(missing)} model parameters, e.g. "
                              f"{missing[:3]}")
    # A universal checkpoint made from weights alone (HF, params-only MaxText) has no moments: the
    # optimizer keeps its fresh state, as when training starts from pretrained weights.
    with_optimizer = load_optimizer_states and not load_module_only and ckpt.has_optimizer_states
    states = (MASTER_WEIGHTS, *ADAM_STATES) if with_optimizer else (MASTER_WEIGHTS, )

    # ZeRO-3 holds each rank's part of the low-precision weights in flat partitions, not in ``param.data``.
    zero3 = bool(engine.zero_optimization_partition_weights())
    with torch.no_grad():
        stage0 = _stage0_slots(engine)
        if with_optimizer:
            _ensure_adam_state(engine, params, stage0)
        for name, param in params:
            if name not in available:
                continue  # frozen parameter the source did not train: keep its constructor value
            layout = getattr(param, LAYOUT_ATTR)
            if math.prod(layout.local_shape(tp_rank)) == 0:
                # This rank holds none of the tensor (a rank beyond the KV-head count); DeepSpeed keeps such
                # empty parameters out of the optimizer, so there is nothing to restore here.
                continue
            for state in states:
                if state != MASTER_WEIGHTS and not ckpt.has(name, state):
                    raise CheckpointError(f"{ckpt.path}: no saved {state} for {name!r}")
                if hasattr(param, "ds_id"):  # ZeRO-3: read only this DP rank's partition of the TP slice
                    _set_zero3_partition(param, ckpt, name, state, layout, tp_rank)
                    continue
                master = state == MASTER_WEIGHTS
                targets = _state_targets(param, None if master else state, engine, stage0)
                if targets is None and not master:
                    raise CheckpointError(f"parameter {name!r} is not managed by a ZeRO/BF16 optimizer; cannot "
                                          "restore its optimizer state")
                if master:  # and the low-precision copy the forward pass uses, whole on every DP rank
                    targets = [*(targets or []), (param.data, 0)]
                _fill(targets or [], ckpt, name, state, layout, tp_rank)
        if zero3:
            _refresh_zero3_partitions(engine.optimizer)
        _restore_buffers(module, ckpt, available, tp_size, tp_rank)

        if with_optimizer:
            _restore_step_and_groups(engine, ckpt, [name for name, _ in params if name in available])

    client_state = _restore_engine_state(engine, ckpt, load_lr_scheduler_states and not load_module_only)
    return str(ckpt.path), client_state


def _restore_buffers(module: torch.nn.Module, ckpt: ReshardingSource, available: set[str], tp_size: int,
                     tp_rank: int) -> None:
    """The persistent buffers the checkpoint carries (DeepSeek-V3's router bias): whole on every rank."""
    for name, buffer in persistent_buffers(module).items():
        if name in available:
            value = ckpt.resharded(name, MASTER_WEIGHTS, TPLayout.replicated(tuple(buffer.shape), tp_size), tp_rank)
            buffer.copy_(value.to(buffer.dtype))


def _refresh_zero3_partitions(optimizer: Any) -> None:
    """Copy ZeRO-3's restored fp32 partitions into the low-precision partitions the forward pass gathers, as
    its own step does after updating them."""
    for sub_group in range(len(optimizer.fp16_groups)):
        optimizer._reassign_or_swap_out_partitioned_parameters(sub_group)


def _ensure_adam_state(engine: Any, params: list[tuple[str, torch.nn.Parameter]],
                       stage0: dict[torch.nn.Parameter, zero0.LiveSlot]) -> None:
    """Create the Adam buffers a fresh engine does not have yet and link each parameter's fragment to them.

    Adam creates its state at the first step, so before that there is nowhere to put restored
    moments. The buffers have the shape of the tensor the optimizer steps (a flat fp32 partition, or
    the parameter), exactly what Adam would create, so Adam then updates them in place.
    """
    base = _base_optimizer(engine)
    # torch's Adam counts steps in a float tensor; DeepSpeed's fused and CPU Adams in a plain int.
    fresh_step = (lambda: torch.tensor(0.0)) if isinstance(base, torch.optim.Adam | torch.optim.AdamW) else int

    def ensure(key: torch.Tensor) -> dict[str, Any]:
        state: dict[str, Any] = base.state[key]
        if any(name not in state for name in ADAM_STATES):
            state.setdefault("step", fresh_step())
            for name in ADAM_STATES:
                state.setdefault(name, torch.zeros_like(key, memory_format=torch.preserve_format))
        return state

    if engine.zero_optimization_partition_weights():
        # ZeRO-3 steps one flat fp32 partition per sub-group (its param groups list them only during a step).
        for flat in engine.optimizer.fp32_partitioned_groups_flat:
            ensure(flat)
        return
    for _, param in params:
        if param in stage0:
            ensure(stage0[param].key)
            continue
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None:
            continue
        flat = base.param_groups[mapping.param_group_index][keys.PARAMS][0]
        state = ensure(flat)
        if not mapping.optim_fragment or any(key not in mapping.optim_fragment for key in ADAM_STATES):
            mapping.set_optim_state_fragment(flat, state)


def _restore_step_and_groups(engine: Any, ckpt: ReshardingSource, names: list[str]) -> None:
    base = _base_optimizer(engine)
    saved = ckpt.optimizer_state_for_universal()
    step = ckpt.step(names[0]) if names else None
    if step is not None:
        # Every tensor the optimizer steps (ZeRO-3's flat partitions are in its param groups only mid-step).
        for state in base.state.values():
            old = state.get("step")
            state["step"] = (torch.tensor(float(step), dtype=old.dtype, device=old.device)
                             if torch.is_tensor(old) else type(old)(step) if old is not None else step)
    _restore_loss_scale(engine.optimizer, saved)
    if keys.CLIP_GRAD in saved and hasattr(engine.optimizer, "clip_grad"):
        engine.optimizer.clip_grad = saved[keys.CLIP_GRAD]
    saved_groups = saved.get(keys.PARAM_GROUPS) or []
    for live, saved in zip(base.param_groups, saved_groups, strict=False):
        for key, value in saved.items():
            if key != keys.PARAMS:
                live[key] = value


#: The running state of a dynamic loss scaler; its policy (factor, window, minimum) comes from the
#: resuming run's config.
_LOSS_SCALE_STATE = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def _restore_loss_scale(optimizer: Any, saved: dict[str, Any]) -> None:
    """Continue fp16 loss scaling where the saved run left it, instead of re-running the overflow search.

    ZeRO optimizers save a ``loss_scaler`` object; the stage-0 FP16 wrappers save its fields flat
    (``cur_scale``, ``cur_iter``, ...) and keep them in ``loss_scale_config``. Either source goes into
    either target.
    """
    scaler = saved.get(keys.LOSS_SCALER)
    fields = dict(vars(scaler)) if scaler is not None and hasattr(scaler, "__dict__") else {}
    fields.update({key: saved[key] for key in _LOSS_SCALE_STATE if key in saved})
    target = getattr(optimizer, "loss_scaler", None) or getattr(optimizer, "loss_scale_config", None)
    if target is None:
        return
    for key in _LOSS_SCALE_STATE:
        if fields.get(key) is not None and hasattr(target, key):
            setattr(target, key, fields[key])


def _restore_engine_state(engine: Any, ckpt: ReshardingSource, load_lr_scheduler: bool) -> dict[str, Any]:
    states = ckpt.model_states
    if load_lr_scheduler and getattr(engine, "lr_scheduler", None) is not None and states.get(keys.LR_SCHEDULER):
        engine.lr_scheduler.load_state_dict(states[keys.LR_SCHEDULER])
    engine.global_steps = int(states.get(keys.GLOBAL_STEPS, 0))
    engine.global_samples = int(states.get(keys.GLOBAL_SAMPLES, engine.global_steps * engine.train_batch_size()))
    engine.skipped_steps = int(states.get(keys.SKIPPED_STEPS, 0))
    engine.loaded_checkpoint_mp_world_size = states.get(keys.MP_WORLD_SIZE)
    engine.loaded_checkpoint_dp_world_size = states.get(keys.DP_WORLD_SIZE)
    return {key: value for key, value in states.items() if key not in keys.DEEPSPEED_STATE_KEYS}
