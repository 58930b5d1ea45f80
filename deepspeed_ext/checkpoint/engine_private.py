"""DeepSpeed's live engine, fenced: the one module that reads or writes a running engine's and optimizer's
internals (flat groups, ``_hp_mapping`` fragments, ZeRO-3 partitions, the loss scaler, swapped states, the
checkpoint engine, tensor-parallel groups).

DeepSpeed changes these between releases without notice; everything deepspeed-ext does to a live engine (the
restore, the save's fingerprints, the save hooks, the tests' state dumps) goes through the functions here, so a
new release is adapted in one file. :func:`check_installed_deepspeed` runs at ``initialize`` and names, in one
line, any part of the installed DeepSpeed that is not what these functions expect, instead of failing deep inside
a save or a load. What a *saved* checkpoint holds is the readers' business (``checkpoint/deepspeed/``): nothing
here touches files.

Without ZeRO (stage 0) DeepSpeed runs the optimizer through one of three wrappers, and each keeps its state
differently (the saved form of each is decoded by :mod:`~deepspeed_ext.checkpoint.deepspeed.zero0`, under the
same names):

* ``FP16_Optimizer`` (fp16/bf16 with a fused Adam): one flat fp32 master per param group, the group's parameters
  concatenated without padding; the torch optimizer's state is keyed by that flat master;
* ``FP16_UnfusedOptimizer`` (fp16/bf16 with any other optimizer): one fp32 master per parameter, and the torch
  state keyed by it;
* no wrapper (fp32): the torch optimizer steps the parameters themselves.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

import torch

from deepspeed_ext.checkpoint.deepspeed import keys
from deepspeed_ext.checkpoint.deepspeed.zero0 import FP16_OPTIMIZER, FP16_UNFUSED_OPTIMIZER, TORCH_OPTIMIZER
from deepspeed_ext.checkpoint.states import MASTER_WEIGHTS, MUON_MOMENTUM, STEP, USE_MUON, optimizer_state_keys
from deepspeed_ext.errors import DeepSpeedExtError

# --------------------------------------------------------------------------- the up-front check
#: What the functions below use of DeepSpeed, by module: ``(attribute path, what uses it)``. An attribute path
#: ``Class.name`` is looked up on the class; ``Class:field`` is a dataclass field.
_REQUIRED: dict[str, tuple[tuple[str, str], ...]] = {
    "deepspeed.utils": (
        ("safe_set_local_fp32_param", "restoring ZeRO-3 fp32 partitions"),
        ("safe_set_local_optimizer_state", "restoring ZeRO-3 optimizer partitions"),
    ),
    "deepspeed.utils.groups": (
        ("get_tensor_model_parallel_world_size", "the AutoTP degree"),
        ("get_tensor_model_parallel_rank", "the AutoTP rank"),
    ),
    "deepspeed.utils.tensor_fragment": (
        ("tensor_fragment.get_hp_fragment", "ZeRO-1/2 fp32 fragments"),
        ("tensor_fragment.set_optim_state_fragment", "linking restored Adam moments"),
        ("tensor_fragment:lp_fragment_address", "where a ZeRO-1/2 fragment starts"),
        ("tensor_fragment:hp_fragment_address", "where a ZeRO-1/2 fragment lies in its flat partition"),
        ("tensor_fragment:param_group_index", "a fragment's param group"),
        ("tensor_fragment:optim_fragment", "a fragment's optimizer state"),
    ),
    "deepspeed.runtime.zero.stage3": (
        ("DeepSpeedZeroOptimizer_Stage3._get_fp32_opt_state_partition", "restoring ZeRO-3 partitions in place"),
        ("DeepSpeedZeroOptimizer_Stage3._reassign_or_swap_out_partitioned_parameters",
         "refreshing ZeRO-3's low-precision partitions"),
        ("DeepSpeedZeroOptimizer_Stage3.get_local_fp32_param", "ZeRO-3 fingerprints"),
    ),
    "deepspeed.runtime.engine": (
        ("DeepSpeedEngine.save_checkpoint", "the save hook"),
        ("DeepSpeedEngine.load_checkpoint", "the load hook"),
        ("DeepSpeedEngine.zero_optimization", "the ZeRO stage"),
        ("DeepSpeedEngine.zero_optimization_stage", "the ZeRO stage"),
        ("DeepSpeedEngine.zero_optimization_partition_weights", "ZeRO-3"),
        ("DeepSpeedEngine.train_batch_size", "the restored sample count"),
        ("DeepSpeedEngine.gradient_clipping", "the gradient clipping the engine runs"),
        ("DeepSpeedEngine.gradient_accumulation_steps", "the accumulation the engine runs"),
        ("DeepSpeedEngine.train_micro_batch_size_per_gpu", "the micro batch the engine runs"),
        ("DeepSpeedEngine.bfloat16_enabled", "the precision the engine runs"),
        ("DeepSpeedEngine.fp16_enabled", "the precision the engine runs"),
        ("DeepSpeedEngine._copy_recovery_script", "a full disk while DeepSpeed copies its recovery scripts"),
        ("DeepSpeedEngine.use_node_local_storage", "which rank commits a save (node-local checkpoints)"),
        ("DeepSpeedEngine.load_universal_checkpoint", "the load route (checkpoint.load_universal)"),
        ("DeepSpeedEngine.step", "reporting a save in the background at the next step"),
        ("DeepSpeedEngine.destroy", "waiting for a save in the background when the engine is destroyed"),
    ),
    "deepspeed.runtime.pipe.engine": (
        ("PipelineEngine.train_batch", "reporting a save in the background at a pipeline's next step"),
    ),
    "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine": (
        ("TorchCheckpointEngine.save", "writing DeepSpeed's files through deepspeed-ext"),
        ("TorchCheckpointEngine.is_decoupled", "telling a decoupled (asynchronous) checkpoint engine"),
    ),
    "deepspeed.runtime.fp16.fused_optimizer": (("FP16_Optimizer", "stage-0 fp16/bf16 with a fused optimizer"), ),
    "deepspeed.runtime.fp16.unfused_optimizer": (("FP16_UnfusedOptimizer", "stage-0 fp16/bf16"), ),
}

#: What ``docs/architecture.md`` says to do when a check fails.
_HOW_TO_ADAPT = "see 'Adding a DeepSpeed release' in deepspeed-ext's docs/architecture.md"


def _has(module: Any, path: str) -> bool:
    owner_name, _, field_name = path.partition(":")
    if field_name:
        owner = getattr(module, owner_name, None)
        return owner is not None and is_dataclass(owner) and field_name in {f.name for f in fields(owner)}
    target = module
    for part in path.split("."):
        if not hasattr(target, part):
            return False
        target = getattr(target, part)
    return True


def missing_deepspeed_parts() -> list[str]:
    """Each part of the installed DeepSpeed the live-engine functions use that is not there, in words."""
    missing = []
    for module_name, required in _REQUIRED.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            missing.append(f"{module_name} does not import ({exc})")
            continue
        missing += [f"{module_name}.{path.replace(':', '.')} (used for {use})" for path, use in required
                    if not _has(module, path)]
    return missing


@functools.cache
def check_installed_deepspeed() -> None:
    """Raise :class:`DeepSpeedExtError` in one line when the installed DeepSpeed lacks anything deepspeed-ext
    reads of a live engine (run once per process, at ``initialize``)."""
    missing = missing_deepspeed_parts()
    if missing:
        import deepspeed
        from deepspeed_ext.version import __version__
        raise DeepSpeedExtError(
            f"DeepSpeed {deepspeed.__version__} changed what deepspeed-ext {__version__} reads of a live engine: "
            f"{'; '.join(missing[:3])}{f' and {len(missing) - 3} more' if len(missing) > 3 else ''} is missing; "
            f"deepspeed-ext supports DeepSpeed 0.18.8 and 0.19.8 ({_HOW_TO_ADAPT})")


# --------------------------------------------------------------------------- groups and the engine's shape
@dataclass(frozen=True)
class LiveExperts:
    """One AutoEP MoE layer of a live model: its stacked expert parameters and this rank's place in its EP group."""

    params: dict[str, torch.nn.Parameter]  # full name -> the local [experts of this rank, ...] stack
    ep_rank: int
    ep_size: int
    num_experts: int


def autoep_layers(model: torch.nn.Module) -> list[LiveExperts]:
    """The AutoEP MoE layers DeepSpeed put in ``model`` (``AutoEPMoELayer``, its ``experts`` stacks); none where
    AutoEP is off or this DeepSpeed has none. Its experts are consecutive per EP rank (``num_experts / ep_size``
    each, EP rank ``r`` holding ``r * that`` onwards), as every AutoEP release places them."""
    found = []
    for path, module in model.named_modules():
        if type(module).__name__ != "AutoEPMoELayer" or not hasattr(module, "experts"):
            continue
        params = {f"{path}.experts.{name}": param for name, param in module.experts.named_parameters()}
        found.append(LiveExperts(params=params, ep_rank=int(module.ep_rank), ep_size=int(module.ep_size),
                                 num_experts=int(module.num_experts)))
    return found


def pipeline_stage(engine: Any) -> tuple[int, int]:
    """``(stage, stages)`` of a pipeline-parallel engine (DeepSpeed's ``PipelineEngine``); ``(0, 1)`` otherwise."""
    return (int(engine.stage_id), int(engine.num_stages)) if engine_is_pipeline(engine) else (0, 1)


def model_parallel_info(engine: Any) -> tuple[int, int]:
    """``(tp_size, tp_rank)`` of ``engine``: a pipeline engine's model-parallel axis of its topology (the
    ``PipeModelDataParallelTopology`` grid; DeepSpeed's TP groups are not set there), else DeepSpeed's TP groups."""
    grid = getattr(engine, "grid", None)
    if engine_is_pipeline(engine) and grid is not None:
        return int(grid.get_slice_parallel_world_size()), int(grid.get_slice_parallel_rank())
    return tp_group_info()


def engine_is_pipeline(engine: Any) -> bool:
    return getattr(engine, "num_stages", None) is not None


def tp_group_info() -> tuple[int, int]:
    """``(tp_size, tp_rank)`` of this process, from DeepSpeed's groups (1, 0 when TP is off)."""
    try:
        from deepspeed.utils import groups
        size = groups.get_tensor_model_parallel_world_size()
        rank = groups.get_tensor_model_parallel_rank()
        return int(size or 1), int(rank or 0)
    except Exception:  # groups not initialised: no tensor parallelism
        return 1, 0


def uses_zero(engine: Any) -> bool:
    """Whether ZeRO (stage 1-3) runs the engine's optimizer."""
    return bool(engine.zero_optimization())


def zero_stage(engine: Any) -> int:
    return int(engine.zero_optimization_stage())


def partitions_weights(engine: Any) -> bool:
    """ZeRO-3: each rank holds a flat partition of the low-precision weights, not ``param.data``."""
    return bool(engine.zero_optimization_partition_weights())


#: The dtypes DeepSpeed keeps a module's weights in apart from its fp32 masters (mixed precision).
LOW_PRECISION = (torch.bfloat16, torch.float16)


def module_weights_apart(engine: Any) -> bool:
    """Whether the engine keeps its module's trainable weights in bf16 or fp16 apart from the fp32 masters, whole
    on every data-parallel rank of its TP slice, as its model-states files save them: ZeRO-0/1/2 with mixed
    precision. Not ZeRO-3 (it partitions them), nor a pipeline or AutoEP engine (its ranks hold different
    layers or experts, which its model-states files do not hold whole)."""
    if partitions_weights(engine) or engine_is_pipeline(engine) or autoep_layers(engine.module):
        return False
    return any(param.dtype in LOW_PRECISION for param in engine.module.parameters() if param.requires_grad)


def step_settings(engine: Any) -> dict[str, Any]:
    """What shapes a step of the engine, as it runs it (its config with DeepSpeed's defaults applied and the batch
    sizes it derived), not as the user's dict spelled it: recorded with every save, read by what continues the run
    elsewhere (to-maxtext's MaxText settings)."""
    dtype = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"
    return {"gradient_clipping": float(engine.gradient_clipping() or 0.0),
            "gradient_accumulation_steps": int(engine.gradient_accumulation_steps()),
            "train_micro_batch_size_per_gpu": int(engine.train_micro_batch_size_per_gpu()),
            "train_batch_size": int(engine.train_batch_size()),
            "dtype": dtype}


def data_parallel_group(engine: Any) -> Any:
    return getattr(engine, "data_parallel_group", None)


def is_zero3_param(param: Any) -> bool:
    """Whether ZeRO-3 manages ``param`` (its data lives in partitions)."""
    return hasattr(param, "ds_id")


def zero3_process_group(param: Any) -> Any:
    """The group ZeRO-3 partitions ``param`` over."""
    return param.ds_process_group


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


# --------------------------------------------------------------------------- ZeRO-3 partitions
def zero3_partition(param: Any) -> tuple[int, int, int]:
    """This rank's ZeRO-3 partition of ``param``: ``(start, stop)`` of the elements it holds in the parameter
    flattened, and the partition's size. Every rank's partition has that size; the last ones are padded past
    the parameter's end, so ``stop - start`` may be smaller, even 0."""
    import torch.distributed as dist
    size, numel = int(param.ds_tensor.ds_numel), int(param.ds_numel)
    start = min(dist.get_rank(group=param.ds_process_group) * size, numel)
    return start, min(start + size, numel), size


def zero3_numel(param: Any) -> int:
    """The elements of ``param`` (its TP-local shape) that ZeRO-3 partitions."""
    return int(param.ds_numel)


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
    as :func:`state_targets` gives them. ZeRO-3: this rank's partition of the low-precision weights (``ds_tensor``,
    its real part); else the parameter itself, whole on every DP rank."""
    if is_zero3_param(param):
        start, stop, _ = zero3_partition(param)
        return [(param.ds_tensor.data.view(-1)[:stop - start], start)]
    return [(param.data.view(-1), 0)]


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


# --------------------------------------------------------------------------- the checkpoint engine
def checkpoint_engine(engine: Any) -> Any:
    """The engine's checkpoint engine (what writes DeepSpeed's files), or None."""
    return getattr(engine, "checkpoint_engine", None)


def saves_in_background(engine: Any) -> bool:
    """Whether a decoupled checkpoint engine writes the files after ``save_checkpoint`` returns."""
    writer = checkpoint_engine(engine)
    return writer is not None and bool(writer.is_decoupled())


def writes_torch_zip_files(engine: Any) -> bool:
    """Whether DeepSpeed's own torch checkpoint engine, in the zip format, writes the engine's files."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    writer = checkpoint_engine(engine)
    return type(writer) is TorchCheckpointEngine and bool(getattr(writer, "zipfile_serialization", False))


@contextlib.contextmanager
def recovery_scripts_copied_by(engine: Any, make_copy: Callable[[Callable[[str], None]], Callable[[str], None]]
                               ) -> Iterator[None]:
    """For the ``with`` block, DeepSpeed's copy of its recovery scripts (``zero_to_fp32.py``) into a save, a write
    outside its checkpoint engine, is done by ``make_copy(its own copy)`` instead."""
    own = getattr(engine, "_copy_recovery_script", None)
    if own is None:
        yield
        return
    engine._copy_recovery_script = make_copy(own)
    try:
        yield
    finally:
        del engine._copy_recovery_script  # the class's own method again


@contextlib.contextmanager
def checkpoint_files_written_by(engine: Any,
                                make_save: Callable[[Callable[[Any, str], None]], Callable[[Any, str], None]]
                                ) -> Iterator[None]:
    """For the ``with`` block, every file DeepSpeed's checkpoint engine writes (``save(state_dict, path)``) is
    written by ``make_save(its own save)`` instead; the checkpoint engine's own method is put back after."""
    writer = checkpoint_engine(engine)
    if writer is None:
        yield
        return
    own = writer.save
    patched_before = "save" in vars(writer)  # someone else's instance attribute: put it back after
    writer.save = make_save(own)
    try:
        yield
    finally:
        if patched_before:
            writer.save = own
        else:
            del writer.save  # the class's own method again


# --------------------------------------------------------------------------- the engine's checkpoint settings
def node_local_storage(engine: Any) -> bool:
    """Whether DeepSpeed keeps the engine's checkpoints on node-local storage (each node holds its ranks' files)."""
    return bool(getattr(engine, "use_node_local_storage", lambda: False)())


def loads_universal(engine: Any) -> bool:
    """The engine's ``checkpoint.load_universal`` setting, as DeepSpeed resolved it."""
    return bool(engine.load_universal_checkpoint())


def data_parallel_size(engine: Any) -> int | None:
    """The engine's data-parallel degree (None where the engine does not say)."""
    size = getattr(engine, "dp_world_size", None)
    return None if size is None else int(size)


def wrap_engine_method(engine: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """Replace the engine's method ``name`` (``save_checkpoint``, ``load_checkpoint``, ``step``, ``train_batch``,
    ``destroy``) on this engine by ``make(its own)``, keeping its name and signature; False where it has none."""
    own = getattr(engine, name, None)
    if own is None:
        return False
    setattr(engine, name, functools.wraps(own)(make(own)))
    return True
