"""``deepspeed_ext.initialize``: ``deepspeed.initialize`` plus UC tagging and the checkpoint hooks, and
:func:`enable`, which makes every ``deepspeed.initialize`` call (the Trainer's, Accelerate's) do the same.

After DeepSpeed builds the engine (and AutoTP has sharded the model), every parameter is tagged with its
:class:`~deepspeed_ext.module_inject.layout.TPLayout`; :func:`attach` then hooks the engine's ``save_checkpoint``
(:mod:`.save`) and ``load_checkpoint`` (:mod:`.load`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from deepspeed_ext.checkpoint import engine_private
from deepspeed_ext.checkpoint.adapters import is_lora_factor
from deepspeed_ext.checkpoint.live_module import adapters_of, model_class_of, model_config_of
from deepspeed_ext.checkpoint.metadata import UCInfo
from deepspeed_ext.config import ExtConfig, load_ds_config
from deepspeed_ext.errors import DeepSpeedExtError
from deepspeed_ext.module_inject.adapters_tp import adapters_kept_under_autotp
from deepspeed_ext.module_inject.inplace_outputs import inplace_outputs_cloned
from deepspeed_ext.module_inject.grouped_attention_tp import grouped_attention_split
from deepspeed_ext.module_inject.linear_attention_tp import linear_attention_split
from deepspeed_ext.module_inject.autotp import name_patterns, tag_autotp_model, unsharded_weights
from deepspeed_ext.runtime import integrations
from deepspeed_ext.runtime.background_save import background_snapshot, wait_at_exit
from deepspeed_ext.runtime.integrations import WRAPPED_ATTR
from deepspeed_ext.runtime.load import hook_load
from deepspeed_ext.runtime.log import logger
from deepspeed_ext.runtime.save import hook_save
from deepspeed_ext.runtime.save_steps import versions

ENGINE_ATTR = "deepspeed_ext_uc_info"


def _ds_config_of_call(args: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpeed config however it was passed to ``deepspeed.initialize``."""
    for key in ("config", "config_params"):
        if kwargs.get(key) is not None:
            return load_ds_config(kwargs[key])
    cli_args = kwargs.get("args", args[0] if args else None)
    path = getattr(cli_args, "deepspeed_config", None)
    return load_ds_config(path) if path is not None else {}


def _deepspeed_initialize() -> Any:
    """DeepSpeed's own ``initialize`` (unwrapped, if :func:`enable` wrapped it)."""
    import deepspeed
    return getattr(deepspeed.initialize, WRAPPED_ATTR, deepspeed.initialize)


def initialize(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
    """Drop-in replacement for ``deepspeed.initialize``: same arguments, same return tuple.

    The engine gets deepspeed-ext's tagging and checkpoint hooks when the config's ``deepspeed_ext`` section
    enables them; without the section this is ``deepspeed.initialize`` exactly.
    """
    ds_config = _ds_config_of_call(args, kwargs)
    ext = ExtConfig.from_ds_config(ds_config)
    if not ext.hooks_engine:
        plain: tuple[Any, ...] = _deepspeed_initialize()(*args, **kwargs)
        return plain
    refuse_autoep_with_incompatible_transformers(ds_config)
    engine_private.check_installed_deepspeed()
    # AutoTP would replace each peft LoRA layer by a shard of its base weight; this keeps and cuts the adapters.
    # Row-split layers whose output the family's model adds to in place (Llama 4's shared expert) get it cloned;
    # gated-DeltaNet linear attention (Qwen3.5, Qwen3-Next) and DeepSeek-V4's grouped-output attention, which
    # AutoTP cannot split, are split by heads.
    with adapters_kept_under_autotp(_tp_grain_size(ds_config)), inplace_outputs_cloned(), \
            linear_attention_split(logger.warning), grouped_attention_split(logger.warning):
        result: tuple[Any, ...] = _deepspeed_initialize()(*args, **kwargs)
    attach(result[0], ext, ds_config)
    return result


def _tp_grain_size(ds_config: dict[str, Any] | None) -> int:
    return int(((ds_config or {}).get("tensor_parallel") or {}).get("tp", {}).get("tp_grain_size", 1) or 1)


#: The newest DeepSpeed release whose AutoEP fails with transformers 5.23 and later; the newest transformers it runs.
_AUTOEP_TRANSFORMERS_LIMIT = ("0.19.8", "5.22.2")


def refuse_autoep_with_incompatible_transformers(ds_config: dict[str, Any]) -> None:
    """One line before the engine is built, instead of a TypeError deep in AutoEP's conversion: DeepSpeed 0.19.8's
    AutoEP retargets transformers' output recorders through a registry that transformers 5.23 made a class with
    another ``get``, so ``initialize`` fails there (``_CanRecordRegistry.get() takes 2 positional arguments``)."""
    section = ds_config.get("expert_parallel") or {}
    if not (isinstance(section, dict) and section.get("enabled")):
        return
    import deepspeed
    import transformers

    def release(version: str) -> tuple[int, ...]:
        return tuple(int(part) for part in version.split("+")[0].split(".")[:3] if part.isdigit())

    deepspeed_limit, transformers_ok = _AUTOEP_TRANSFORMERS_LIMIT
    if release(deepspeed.__version__) <= release(deepspeed_limit) and \
            release(transformers.__version__) > release(transformers_ok):
        raise DeepSpeedExtError(f"DeepSpeed {deepspeed.__version__}'s AutoEP (expert_parallel.enabled) fails at "
                                f"initialize with transformers {transformers.__version__}: it needs transformers <= "
                                f"{transformers_ok} (pip install transformers=={transformers_ok}; docs/install.md)")


def enable() -> None:
    """Make every ``deepspeed.initialize`` call act as :func:`initialize`: the Hugging Face Trainer's and
    Accelerate's (which look ``deepspeed.initialize`` up when they call it), and the script's own.

    Explicit and reversible (:func:`disable`); calling it twice is harmless. It changes nothing for a config
    without the ``deepspeed_ext`` section, so one script serves runs with and without it. The Trainer's
    ``resume_from_checkpoint=True`` then also resumes from the newest ``checkpoint-N`` whose save finished.
    """
    import deepspeed
    if hasattr(deepspeed.initialize, WRAPPED_ATTR):
        return
    original = deepspeed.initialize

    @functools.wraps(original)
    def deepspeed_initialize_with_ext(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
        return initialize(*args, **kwargs)

    integrations.install(True)  # checks the installed transformers / Accelerate before patching anything
    setattr(deepspeed_initialize_with_ext, WRAPPED_ATTR, original)
    deepspeed.initialize = deepspeed_initialize_with_ext


def disable() -> None:
    """Undo :func:`enable`: ``deepspeed.initialize`` is DeepSpeed's own again (engines built meanwhile keep
    their hooks), and so is the Trainer's choice of the checkpoint to resume from."""
    import deepspeed
    deepspeed.initialize = _deepspeed_initialize()
    integrations.install(False)


def enabled() -> bool:
    """Whether :func:`enable` is in effect."""
    import deepspeed
    return hasattr(deepspeed.initialize, WRAPPED_ATTR)


def attach(engine: Any, ext: ExtConfig, ds_config: dict[str, Any] | None = None) -> UCInfo:
    """Tag ``engine.module`` and hook the engine's checkpoint methods. Returns the UC info."""
    engine_private.check_installed_deepspeed()  # a DeepSpeed release we cannot serve fails here, in one line
    tp_size, tp_rank = engine_private.model_parallel_info(engine)
    layouts = tag_autotp_model(engine.module, tp_size=tp_size, tp_rank=tp_rank, tp_grain_size=_tp_grain_size(ds_config))
    layouts = _over_every_stage(engine, layouts)
    if engine_private.partitions_weights(engine):
        refuse_empty_shards_under_zero3(layouts)
    info = UCInfo(tp_size=tp_size,
                  layouts=layouts,
                  model_config=model_config_of(engine.module),
                  model_class=model_class_of(engine.module),
                  versions=versions(),
                  engine_settings=engine_private.step_settings(engine),
                  frozen=_frozen_over_every_stage(engine),
                  adapters=adapters_of(engine.module))
    setattr(engine, ENGINE_ATTR, info)
    stacked = unsharded_weights(layouts, min_ndim=3)
    if stacked and engine.global_rank == 0:
        logger.warning("AutoTP cannot shard %d parameters that are not nn.Linear weights (e.g. fused MoE expert "
                       "stacks); every TP rank keeps them whole, and checkpoints hold them as replicated: %s",
                       len(stacked), ", ".join(name_patterns(stacked)))
    matrices = [name for name in unsharded_weights(layouts, min_ndim=2)
                if name not in stacked and not is_lora_factor(name)]
    if matrices and engine.global_rank == 0:
        logger.warning("AutoTP left %d weight matrices whole on every TP rank (the tensor-parallel config does not "
                       "split them, or the layer cannot be split); checkpoints hold them as replicated: %s",
                       len(matrices), ", ".join(name_patterns(matrices)))
    hook_save(engine, info, ext.universal_checkpoint.fingerprints,
               snapshot=background_snapshot(engine, ext.async_snapshot) if ext.async_save else None)
    hook_load(engine, reshard=ext.universal_checkpoint.restore == "deepspeed_ext",
               fingerprints=ext.universal_checkpoint.fingerprints)
    wait_at_exit()
    return info


def _frozen_over_every_stage(engine: Any) -> list[str]:
    """The engine's frozen parameters (``requires_grad=False``; each tensor once, as ``named_parameters`` names it),
    of every pipeline stage: what the checkpoints record, so that a reader never takes a second name of a trainable
    tensor (AutoEP's router, reachable under two names) for a frozen one."""
    frozen = [name for name, param in engine.module.named_parameters() if not param.requires_grad]
    if not engine_private.engine_is_pipeline(engine):
        return frozen
    import torch.distributed as dist
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, frozen)
    return list(dict.fromkeys(name for names in gathered for name in names))


def _over_every_stage(engine: Any, layouts: dict[str, Any]) -> dict[str, Any]:
    """A pipeline-parallel engine's layouts, gathered from every stage (each holds its own layers); the record
    saved with each checkpoint describes the whole model. ``layouts`` itself without pipeline parallelism."""
    if engine_private.pipeline_stage(engine)[1] == 1:
        return layouts
    import torch.distributed as dist

    from deepspeed_ext.module_inject.layout import TPLayout
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {name: layout.to_json() for name, layout in layouts.items()})
    merged: dict[str, Any] = {}
    for stage_layouts in gathered:
        for name, data in stage_layouts.items():
            merged.setdefault(name, TPLayout.from_json(data))
    return {**merged, **layouts}


def refuse_empty_shards_under_zero3(layouts: dict[str, Any]) -> None:
    """One line instead of DeepSpeed's assertion at the first forward pass: ZeRO-3 cannot gather a parameter
    that is empty on some TP rank, which AutoTP produces when autotp_size exceeds the KV-head count."""
    import math

    import deepspeed

    from deepspeed_ext.errors import UnsupportedGeometryError
    for name, layout in layouts.items():
        empty = [rank for rank in range(layout.tp_size) if math.prod(layout.local_shape(rank)) == 0]
        if empty:
            raise UnsupportedGeometryError(
                f"DeepSpeed {deepspeed.__version__} ZeRO-3 cannot train at autotp_size={layout.tp_size}: TP rank(s) "
                f"{empty} would hold an empty shard of {name!r} ({layout.describe()}), as happens when autotp_size "
                "exceeds the model's KV-head count; use ZeRO stage 0-2, or an autotp_size that gives every rank "
                "a shard")
