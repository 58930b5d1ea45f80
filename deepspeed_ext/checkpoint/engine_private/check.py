"""The up-front check of the installed DeepSpeed: every part the fence reads, named in one line when missing."""

from __future__ import annotations

import functools
import importlib
from dataclasses import fields, is_dataclass
from typing import Any

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
        ("get_tensor_model_parallel_group", "the collectives of LoRA adapters under AutoTP"),
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
        ("DeepSpeedEngine._configure_tensor_parallel", "sharding LoRA adapters as AutoTP shards their base layers"),
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
        ("DeepSpeedEngine._get_ckpt_name", "the model-states file each rank reads (node-local checkpoints)"),
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
    "deepspeed.module_inject.layers": (
        ("TensorParallel_Layer", "finding AutoTP's layers"),
        ("LinearLayer", "column-parallel layers' splits"),
        ("LinearAllreduce", "row-parallel layers' splits"),
        ("DS_TENSOR_MODEL_PARALLEL", "the gradient norm of LoRA adapters cut under AutoTP"),
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
