"""Writing restored state into a live engine: ZeRO-3 partitions, optimizer states and scalars, param groups, the
loss scaler, the step counters and the scheduler."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from deepspeed_ext.checkpoint.deepspeed import keys
from deepspeed_ext.checkpoint.engine_private.engine import is_zero3_param, partitions_weights, zero3_partition
from deepspeed_ext.checkpoint.engine_private.optimizer import LiveSlot, base_optimizer
from deepspeed_ext.checkpoint.states import MASTER_WEIGHTS, MUON_MOMENTUM, STEP, USE_MUON, optimizer_state_keys
from deepspeed_ext.errors import CheckpointError

# --------------------------------------------------------------------------- ZeRO-3 partitions




def zero3_partition_in_place(param: Any, state: str, size: int) -> torch.Tensor | None:
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


def no_optimizer_holds(param: Any, stage0: Mapping[Any, LiveSlot]) -> bool:
    """Whether ``param`` is frozen as a checkpoint keeps it (its weights alone): ``requires_grad=False`` and held by
    no optimizer. A stage-0 wrapper of DeepSpeed 0.18.8 holds every parameter it was handed, frozen ones too (an
    fp32 master it copies into the weights at each step, moments of zero gradients): such a one is as the others."""
    return not param.requires_grad and param not in stage0


def frozen_weight_targets(param: Any) -> list[tuple[torch.Tensor, int]]:
    """Where this rank keeps a frozen parameter's weights (no optimizer holds them): ``(1-D tensor, start)`` pairs
    as :func:`state_targets` gives them (see :func:`held_weights`)."""
    return [held_weights(param)]


def held_weights(param: Any) -> tuple[torch.Tensor, int]:
    """The module's weights of ``param`` this rank keeps, as ``(1-D tensor, start)`` in its TP-local shard
    flattened: under ZeRO-3 its partition (``ds_tensor``, the real part), else the parameter itself, whole. What
    the forward pass computes with, trainable or frozen. A partition ZeRO-3 keeps on NVMe (``offload_param``) is
    not in memory and is refused."""
    if is_zero3_param(param):
        start, stop, _ = zero3_partition(param)
        local = param.ds_tensor.data.view(-1)
        if local.numel() < stop - start:
            raise CheckpointError(f"a ZeRO-3 partition of {tuple(param.ds_shape)} is not in memory (offload_param to "
                                  "NVMe): its weights cannot be read from the live engine")
        return local[:stop - start], start
    return param.data.view(-1), 0


def owned_frozen_weights(param: Any, dp_rank: int) -> torch.Tensor | None:
    """The part of a frozen parameter's weights this rank speaks for in the fingerprints: its ZeRO-3 partition
    (the real part), else the whole tensor on DP rank 0."""
    if is_zero3_param(param):
        return frozen_weight_targets(param)[0][0]
    return param.data if dp_rank == 0 else None


def set_zero3_partition(param: Any, state: str, value: torch.Tensor) -> None:
    """Set this rank's whole ZeRO-3 partition of ``state`` through DeepSpeed's public setters (the path for
    swapped optimizer states, where :func:`zero3_partition_in_place` has nothing)."""
    from deepspeed.utils import safe_set_local_fp32_param, safe_set_local_optimizer_state
    if state == MASTER_WEIGHTS:
        safe_set_local_fp32_param(param, value)
    else:
        safe_set_local_optimizer_state(param, value, state)


def refresh_zero3_partitions(engine: Any) -> None:
    """Copy ZeRO-3's restored fp32 partitions into the low-precision partitions the forward pass gathers, as
    its own step does after updating them."""
    optimizer = engine.optimizer
    for sub_group in range(len(optimizer.fp16_groups)):
        optimizer._reassign_or_swap_out_partitioned_parameters(sub_group)


# --------------------------------------------------------------------------- restoring optimizer state
def live_tensor_states(engine: Any) -> tuple[str, ...]:
    """The tensor states the engine's optimizer keeps (Adam's moments, Muon's or SGD's momentum, ...), by key."""
    base = base_optimizer(engine)
    found: dict[str, None] = {}
    for state in (base.state.values() if base is not None else ()):
        if isinstance(state, Mapping):
            found.update(dict.fromkeys(optimizer_state_keys(state)[0]))
    return tuple(found)


def expected_tensor_states(base: Any, group: Mapping[str, Any]) -> set[str] | None:
    """The tensor states the live optimizer keeps for a param group once it steps, for the optimizers whose keys
    are known (None: another optimizer, not checked): a checkpoint of one optimizer restored into a run of another
    would leave the optimizer without the states it reads at its first step."""
    name = type(getattr(base, "aux_optimizer", None) or base).__name__ if USE_MUON not in group else "Muon"
    if name == "Muon":
        return {MUON_MOMENTUM} if group.get(USE_MUON) else {"exp_avg", "exp_avg_sq"}
    if "Adam" in name:  # torch's Adam/AdamW, DeepSpeed's FusedAdam and CPUAdam
        return {"exp_avg", "exp_avg_sq", *(("max_exp_avg_sq", ) if group.get("amsgrad") else ())}
    if name == "SGD":
        return {MUON_MOMENTUM} if group.get("momentum") else set()
    if name == "Adagrad":
        return {"sum"}
    return None


class StateEntries:
    """Where the torch optimizer keeps each parameter's state on this rank: the tensor its state is keyed by (a
    flat partition, a master, the parameter itself) and the param group that steps it; found once per restore."""

    def __init__(self, engine: Any, stage0: Mapping[Any, LiveSlot]):
        self.base = base_optimizer(engine)
        self._stage0 = stage0
        self._zero3: dict[Any, torch.Tensor] = {}
        if partitions_weights(engine):  # each sub-group's flat fp32 partition (its param groups list it mid-step)
            optimizer = engine.optimizer
            self._zero3 = {param: flat for params, flat in zip(optimizer.fp16_groups,
                                                               optimizer.fp32_partitioned_groups_flat, strict=True)
                           for param in params}
        self._groups = {id(key): group for group in self.base.param_groups for key in group[keys.PARAMS]}

    def key(self, param: Any) -> torch.Tensor | None:
        """The tensor ``param``'s state is keyed by; None where this rank keeps none of it."""
        if param in self._stage0:
            return self._stage0[param].key
        if is_zero3_param(param):
            return self._zero3.get(param)
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None:
            return None
        key: torch.Tensor = self.base.param_groups[mapping.param_group_index][keys.PARAMS][0]
        return key

    def group(self, param: Any) -> Mapping[str, Any] | None:
        """The live param group that steps ``param`` (its hyperparameters; Muon's ``use_muon``)."""
        key = self.key(param)
        return self._groups.get(id(key)) if key is not None else None


def ensure_optimizer_states(engine: Any, wanted: Mapping[Any, tuple[str, ...]], entries: StateEntries,
                            whole: Mapping[torch.nn.Parameter, tuple[int, int]]) -> None:
    """Create the tensor states a fresh optimizer does not have yet, for each parameter of ``wanted`` (``param ->
    its tensor states``), and link each ZeRO-1/2 fragment to them (the scalars: :func:`set_optimizer_scalars`).

    Optimizers create their state at the first step (torch's Adam, SGD, DeepSpeed's Muon), so before that there is
    nowhere to put restored states. Each tensor state has the shape of the tensor the optimizer steps (a flat fp32
    partition, or the parameter), as the optimizer would create it, so it then updates it in place; Muon's momentum
    under ZeRO-1/2 holds the partition's whole parameters (fp32: DeepSpeed casts it to its gradients' dtype at its
    first use, as it does a momentum its own load restored).
    """
    base = entries.base
    for param, tensors in wanted.items():
        key = entries.key(param)
        if key is None:
            continue
        state: dict[str, Any] = base.state[key]
        added = False
        for name in tensors:
            if name in state:
                continue
            added = True
            if name == MUON_MOMENTUM and param in whole:
                group, _ = whole[param]
                size = sum(p.numel() for p in engine.optimizer.params_in_partition[group])
                state[name] = torch.zeros(size, dtype=torch.float32, device=key.device)
            else:
                state[name] = torch.zeros_like(key, memory_format=torch.preserve_format)
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is not None and not is_zero3_param(param) and (
                added or not mapping.optim_fragment):
            mapping.set_optim_state_fragment(key, state)


def _fresh_scalar(base: Any, name: str, saved: Any) -> Any:
    """A scalar state as the live optimizer keeps it: torch's optimizers count steps in a float tensor (so does
    the torch Adam that DeepSpeed's Muon may step its other parameters with), DeepSpeed's own in a plain int."""
    if name != STEP:
        return saved.clone() if torch.is_tensor(saved) else saved
    number = saved.item() if torch.is_tensor(saved) else saved
    stepper = getattr(base, "aux_optimizer", None) or base
    if type(stepper).__module__.startswith("torch.optim"):
        return torch.tensor(float(number))
    return int(number)


def set_optimizer_scalars(values: Mapping[Any, Mapping[str, Any]], entries: StateEntries) -> None:
    """Each parameter's param-group scalars (``param -> {state: saved value}``: the step), in the type the
    optimizer keeps them (a float tensor for torch's Adam, a plain int for DeepSpeed's fused and CPU Adams), created
    where a fresh optimizer has none yet (:func:`_fresh_scalar`)."""
    for param, scalars in values.items():
        key = entries.key(param)
        if key is None:
            continue
        state = entries.base.state[key]
        for name, value in scalars.items():
            old = state.get(name)
            number = value.item() if torch.is_tensor(value) else value
            state[name] = (torch.tensor(float(number), dtype=old.dtype, device=old.device) if torch.is_tensor(old)
                           else type(old)(number) if old is not None else _fresh_scalar(entries.base, name, value))


def set_optimizer_groups(engine: Any, saved: Mapping[str, Any]) -> None:
    """Loss scaling, gradient clipping and each param group's hyperparameters, from ``saved`` (the summary
    ``zero/optimizer_state.pt`` keeps)."""
    base = base_optimizer(engine)
    _restore_loss_scale(engine.optimizer, saved)
    if keys.CLIP_GRAD in saved and hasattr(engine.optimizer, "clip_grad"):
        engine.optimizer.clip_grad = saved[keys.CLIP_GRAD]
    saved_groups = saved.get(keys.PARAM_GROUPS) or []
    for live, saved_group in zip(base.param_groups, saved_groups, strict=False):
        for key, value in saved_group.items():
            # A group's name and MoE mark say which ranks it spans here (AutoEP's ``ep_size_<N>``), not a setting
            # to carry over from a run at another EP degree.
            if key not in (keys.PARAMS, *_GROUP_IDENTITY):
                live[key] = value


#: Param-group keys that identify a group among the live engine's rather than set how it steps.
_GROUP_IDENTITY = ("name", "moe")


#: The running state of a dynamic loss scaler; its policy (factor, window, minimum) comes from the
#: resuming run's config.
_LOSS_SCALE_STATE = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def _restore_loss_scale(optimizer: Any, saved: Mapping[str, Any]) -> None:
    """Continue fp16 loss scaling where the saved run left it, instead of re-running the overflow search.

    ZeRO optimizers save a ``loss_scaler`` object; the stage-0 FP16 wrappers save its fields flat
    (``cur_scale``, ``cur_iter``, ...) and keep them in ``loss_scale_config``. Either source goes into
    either target.
    """
    scaler = saved.get(keys.LOSS_SCALER)
    found = dict(vars(scaler)) if scaler is not None and hasattr(scaler, "__dict__") else {}
    found.update({key: saved[key] for key in _LOSS_SCALE_STATE if key in saved})
    target = getattr(optimizer, "loss_scaler", None) or getattr(optimizer, "loss_scale_config", None)
    if target is None:
        return
    for key in _LOSS_SCALE_STATE:
        if found.get(key) is not None and hasattr(target, key):
            setattr(target, key, found[key])


def set_engine_counters(engine: Any, states: Mapping[str, Any], load_lr_scheduler: bool) -> None:
    """The engine's step and sample counters, the saved degrees it reports, and the LR scheduler, from the
    model states of a checkpoint."""
    scheduler = getattr(engine, "lr_scheduler", None) if load_lr_scheduler else None
    if scheduler is not None and states.get(keys.LR_SCHEDULER):
        scheduler.load_state_dict(states[keys.LR_SCHEDULER])
    elif scheduler is not None and int(states.get(keys.GLOBAL_STEPS, 0)) > 0:
        _position_scheduler(scheduler, int(states[keys.GLOBAL_STEPS]))
    engine.global_steps = int(states.get(keys.GLOBAL_STEPS, 0))
    engine.global_samples = int(states.get(keys.GLOBAL_SAMPLES, engine.global_steps * engine.train_batch_size()))
    engine.skipped_steps = int(states.get(keys.SKIPPED_STEPS, 0))
    engine.loaded_checkpoint_mp_world_size = states.get(keys.MP_WORLD_SIZE)
    engine.loaded_checkpoint_dp_world_size = states.get(keys.DP_WORLD_SIZE)


def _position_scheduler(scheduler: Any, global_steps: int) -> None:
    """A checkpoint with a step count but no scheduler state (converted from MaxText or Hugging Face weights): put
    the run's scheduler where ``global_steps`` optimizer steps leave it. DeepSpeed's own schedulers (WarmupLR,
    WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest) step once per optimizer step from -1 and take the
    iteration to jump to; ``step(n)`` also sets the optimizer's rates. Other schedulers start at their beginning,
    said in a warning."""
    if isinstance(getattr(scheduler, "last_batch_iteration", None), int):
        scheduler.step(global_steps - 1)
        return
    import logging
    logging.getLogger("deepspeed_ext").warning(
        "the checkpoint records no learning-rate scheduler state (converted from another framework); %s starts at "
        "its beginning, not at step %d", type(scheduler).__name__, global_steps)
