"""A live engine's shape (TP, PP, DP, ZeRO, AutoEP), its groups, its checkpoint engine and the methods the runtime
hooks."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch


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


def model_states_file(engine: Any) -> str:
    """The model-states file this rank reads when it resumes at the degrees it saved at, by DeepSpeed's name for it
    (``mp_rank_01_model_states.pt``; ZeRO-3's ``zero_pp_rank_0_mp_rank_01_model_states.pt``)."""
    import os
    return str(os.path.basename(engine._get_ckpt_name("", "tag")))


def writes_model_states(engine: Any) -> bool | None:
    """Whether DeepSpeed will write this rank's model-states file at a save (None: the engine does not say)."""
    value = getattr(engine, "save_non_zero_checkpoint", None)
    return None if value is None else bool(value)


def set_writes_model_states(engine: Any, writes: bool) -> None:
    """Make DeepSpeed write this rank's model-states file at its saves (or not)."""
    engine.save_non_zero_checkpoint = writes


def has_moe_layers(engine: Any) -> bool:
    """Whether DeepSpeed saves the engine through its MoE path (expert files of their own)."""
    return bool(getattr(engine, "has_moe_layers", False))


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


def stored_shape(param: torch.Tensor) -> tuple[int, ...]:
    """Shape of the local shard, also under ZeRO-3 where ``param.shape`` is an empty placeholder."""
    ds_shape = getattr(param, "ds_shape", None)
    return tuple(ds_shape) if ds_shape is not None else tuple(param.shape)
