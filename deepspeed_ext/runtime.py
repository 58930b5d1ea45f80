"""Engine integration: ``deepspeed_ext.initialize`` = ``deepspeed.initialize`` + UC tagging and hooks.

After DeepSpeed builds the engine (and AutoTP has sharded the model), every parameter is tagged with
its :class:`~deepspeed_ext.module_inject.layout.TPLayout`. The engine's ``save_checkpoint`` then also
writes ``deepspeed_ext.json`` (layouts + model config) into the tag directory, and, when the config
sets ``"checkpoint": {"load_universal": true}``, ``load_checkpoint`` restores universal checkpoints
through :mod:`deepspeed_ext.checkpoint.restore`. The training script changes in one line.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import os
import shutil
import time
import weakref
from pathlib import Path
from typing import Any

import torch

from deepspeed_ext.checkpoint.metadata import UCInfo, write_uc_info
from deepspeed_ext.config import ExtConfig, load_ds_config
from deepspeed_ext.errors import CheckpointError, DeepSpeedExtError, first_line
from deepspeed_ext.version import __version__
from deepspeed_ext.checkpoint import engine_private
from deepspeed_ext.module_inject.autotp import name_patterns, tag_autotp_model, unsharded_weights

ENGINE_ATTR = "deepspeed_ext_uc_info"
logger = logging.getLogger("deepspeed_ext")
if not logger.handlers:  # the training log shows our lines beside DeepSpeed's; configurable by name as usual
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[deepspeed-ext] %(levelname)s: %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _ds_config_of_call(args: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpeed config however it was passed to ``deepspeed.initialize``."""
    for key in ("config", "config_params"):
        if kwargs.get(key) is not None:
            return load_ds_config(kwargs[key])
    cli_args = kwargs.get("args", args[0] if args else None)
    path = getattr(cli_args, "deepspeed_config", None)
    return load_ds_config(path) if path is not None else {}


#: Marks the ``deepspeed.initialize`` that :func:`enable` installs; holds the function it wraps.
_WRAPPED_ATTR = "__deepspeed_ext_wraps__"


def _deepspeed_initialize() -> Any:
    """DeepSpeed's own ``initialize`` (unwrapped, if :func:`enable` wrapped it)."""
    import deepspeed
    return getattr(deepspeed.initialize, _WRAPPED_ATTR, deepspeed.initialize)


def initialize(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
    """Drop-in replacement for ``deepspeed.initialize``: same arguments, same return tuple.

    The engine gets deepspeed-ext's tagging and checkpoint hooks when the config's ``deepspeed_ext`` section
    enables them; without the section this is ``deepspeed.initialize`` exactly.
    """
    ds_config = _ds_config_of_call(args, kwargs)
    ext = ExtConfig.from_ds_config(ds_config)
    if ext.hooks_engine:
        refuse_autoep_with_incompatible_transformers(ds_config)
    result: tuple[Any, ...] = _deepspeed_initialize()(*args, **kwargs)
    if ext.hooks_engine:
        attach(result[0], ext, ds_config)
    return result


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
    if hasattr(deepspeed.initialize, _WRAPPED_ATTR):
        return
    original = deepspeed.initialize

    @functools.wraps(original)
    def deepspeed_initialize_with_ext(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
        return initialize(*args, **kwargs)

    setattr(deepspeed_initialize_with_ext, _WRAPPED_ATTR, original)
    deepspeed.initialize = deepspeed_initialize_with_ext
    _trainer_resume_choice(install=True)
    _saves_wait_for_background_commits(install=True)


def disable() -> None:
    """Undo :func:`enable`: ``deepspeed.initialize`` is DeepSpeed's own again (engines built meanwhile keep
    their hooks), and so is the Trainer's choice of the checkpoint to resume from."""
    import deepspeed
    deepspeed.initialize = _deepspeed_initialize()
    _trainer_resume_choice(install=False)
    _saves_wait_for_background_commits(install=False)


def _trainer_resume_choice(install: bool) -> None:
    """With ``install``: the Hugging Face Trainer's ``resume_from_checkpoint=True`` resumes from the newest
    *complete* ``checkpoint-N`` (transformers' ``get_last_checkpoint`` takes the highest N, even one whose save
    was killed half-way), skipping each newer one with a warning that names it. Without: transformers' own
    again. Nothing happens where transformers is not installed."""
    import importlib.util
    import sys
    if importlib.util.find_spec("transformers") is None:
        return
    trainer_utils = importlib.import_module("transformers.trainer_utils")
    current = trainer_utils.get_last_checkpoint
    own = getattr(current, _WRAPPED_ATTR, current)
    if install and own is current:
        @functools.wraps(own)
        def get_last_checkpoint(folder: Any) -> Any:
            from deepspeed_ext.checkpoint.locate import trainer_checkpoints
            if own(folder) is None:
                return None
            newest, skipped = trainer_checkpoints(Path(folder))
            for skipped_folder, reason in skipped:
                logger.warning("not resuming from %s: %s", skipped_folder, reason)
            return None if newest is None else str(newest)

        setattr(get_last_checkpoint, _WRAPPED_ATTR, own)
        replacement: Any = get_last_checkpoint
    elif not install:
        replacement = own
    else:
        return
    trainer_utils.get_last_checkpoint = replacement
    trainer = sys.modules.get("transformers.trainer")  # imported the function by name already
    if trainer is not None and getattr(trainer, "get_last_checkpoint", None) in (current, own):
        trainer.get_last_checkpoint = replacement


def _saves_wait_for_background_commits(install: bool) -> None:
    """With ``install``, where a save is written in the background (``async_save``):

    * the Hugging Face Trainer's rotation of its ``checkpoint-N`` folders (``save_total_limit``), which runs right
      after a save returns, waits for that save's commit: it runs then, on the next step that finds it committed
      (or at the exit), and not at all if the save failed. Run at once, it would delete the newest committed
      checkpoint while the one replacing it is still being written;
    * Accelerate's ``save_state``, which deletes its oldest folders (``total_limit``) before it saves, first waits
      for the save in the background to commit.

    Without: transformers' and Accelerate's own again. Nothing happens where they are not installed."""
    import importlib.util
    import sys
    if importlib.util.find_spec("transformers") is not None:
        trainer_utils = importlib.import_module("transformers.trainer_utils")
        current = getattr(trainer_utils, "rotate_checkpoints", None)
        if current is not None:
            own = getattr(current, _WRAPPED_ATTR, current)
            replacement = own
            if install:
                @functools.wraps(own)
                def rotate_checkpoints(output_dir: Any, *args: Any, **kwargs: Any) -> Any:
                    inside = [pending for pending in _PENDING if _is_within(pending.save_dir, output_dir)]
                    if not inside:
                        return own(output_dir, *args, **kwargs)
                    inside[-1].after_commit.append(
                        functools.partial(_rotate_keeping_the_newest_complete, own, output_dir, *args, **kwargs))
                    logger.info("rotating the checkpoints of %s once %s is committed", output_dir, inside[-1].tag)
                    return None

                setattr(rotate_checkpoints, _WRAPPED_ATTR, own)
                replacement = rotate_checkpoints
            trainer_utils.rotate_checkpoints = replacement
            trainer = sys.modules.get("transformers.trainer")  # imported the function by name already
            if trainer is not None and getattr(trainer, "rotate_checkpoints", None) in (current, own):
                trainer.rotate_checkpoints = replacement
    if importlib.util.find_spec("accelerate") is not None:
        accelerator = importlib.import_module("accelerate").Accelerator
        current_save = accelerator.save_state
        own_save = getattr(current_save, _WRAPPED_ATTR, current_save)
        if install and own_save is current_save:
            @functools.wraps(own_save)
            def save_state(self: Any, *args: Any, **kwargs: Any) -> Any:
                for engine in list(_BACKGROUND_ENGINES):
                    settle_background_save(engine, block=True)
                return own_save(self, *args, **kwargs)

            setattr(save_state, _WRAPPED_ATTR, own_save)
            accelerator.save_state = save_state
        elif not install:
            accelerator.save_state = own_save


def _rotate_keeping_the_newest_complete(own: Any, output_dir: Any, *args: Any, **kwargs: Any) -> None:
    """transformers' ``rotate_checkpoints(output_dir, ...)`` (``own``), run once a save in the background has
    committed, that also keeps the newest complete ``checkpoint-N``: by then the Trainer may have begun the next
    checkpoint (its folder newest, its save not finished), which transformers' rotation would keep in its stead."""
    from transformers.trainer_utils import sort_checkpoints

    from deepspeed_ext.checkpoint.locate import trainer_checkpoints
    options = inspect.signature(own).bind(output_dir, *args, **kwargs)
    options.apply_defaults()
    limit, best = options.arguments.get("save_total_limit"), options.arguments.get("best_model_checkpoint")
    prefix = options.arguments.get("checkpoint_prefix", "checkpoint")
    newest_complete = trainer_checkpoints(Path(output_dir))[0]
    if newest_complete is None or not limit or limit <= 0:
        return own(output_dir, *args, **kwargs)
    checkpoints = sort_checkpoints(str(output_dir), prefix, bool(options.arguments.get("use_mtime", False)))
    if not checkpoints:
        return None
    protected = {checkpoints[-1], str(newest_complete), *([str(Path(best))] if best else [])}
    remaining = len(checkpoints)
    for folder in checkpoints:
        if remaining <= max(limit, len(protected)):
            break
        if folder not in protected:
            shutil.rmtree(folder, ignore_errors=True)
            remaining -= 1
    return None


def _is_within(path: str | os.PathLike[str], folder: str | os.PathLike[str]) -> bool:
    path, folder = Path(os.path.abspath(path)), Path(os.path.abspath(folder))
    return path == folder or folder in path.parents


def enabled() -> bool:
    """Whether :func:`enable` is in effect."""
    import deepspeed
    return hasattr(deepspeed.initialize, _WRAPPED_ATTR)


def _model_config_dict(module: torch.nn.Module) -> dict[str, Any] | None:
    config = getattr(module, "config", None)
    if config is None:
        return None
    if hasattr(config, "to_json_string"):
        return json.loads(config.to_json_string(use_diff=False))
    try:
        return json.loads(json.dumps(vars(config), default=str))
    except TypeError:
        return None


def _versions() -> dict[str, str]:
    import deepspeed
    return {"deepspeed_ext": __version__, "deepspeed": deepspeed.__version__, "torch": torch.__version__}


def attach(engine: Any, ext: ExtConfig, ds_config: dict[str, Any] | None = None) -> UCInfo:
    """Tag ``engine.module`` and hook the engine's checkpoint methods. Returns the UC info."""
    engine_private.check_installed_deepspeed()  # a DeepSpeed release we cannot serve fails here, in one line
    tp_size, tp_rank = engine_private.model_parallel_info(engine)
    grain = int(((ds_config or {}).get("tensor_parallel") or {}).get("tp", {}).get("tp_grain_size", 1) or 1)
    layouts = tag_autotp_model(engine.module, tp_size=tp_size, tp_rank=tp_rank, tp_grain_size=grain)
    layouts = _over_every_stage(engine, layouts)
    if engine_private.partitions_weights(engine):
        refuse_empty_shards_under_zero3(layouts)
    info = UCInfo(tp_size=tp_size,
                  layouts=layouts,
                  model_config=_model_config_dict(engine.module),
                  model_class=type(engine.module).__name__,
                  versions=_versions(),
                  engine_settings=engine_private.step_settings(engine),
                  frozen=_frozen_over_every_stage(engine))
    setattr(engine, ENGINE_ATTR, info)
    stacked = unsharded_weights(layouts, min_ndim=3)
    if stacked and engine.global_rank == 0:
        logger.warning("AutoTP cannot shard %d parameters that are not nn.Linear weights (e.g. fused MoE expert "
                       "stacks); every TP rank keeps them whole, and checkpoints hold them as replicated: %s",
                       len(stacked), ", ".join(name_patterns(stacked)))
    matrices = [name for name in unsharded_weights(layouts, min_ndim=2) if name not in stacked]
    if matrices and engine.global_rank == 0:
        logger.warning("AutoTP left %d weight matrices whole on every TP rank (the tensor-parallel config does not "
                       "split them, or the layer cannot be split); checkpoints hold them as replicated: %s",
                       len(matrices), ", ".join(name_patterns(matrices)))
    _hook_save(engine, info, ext.universal_checkpoint.fingerprints,
               in_background=ext.async_save and _can_save_in_background(engine))
    _hook_load(engine, reshard=ext.universal_checkpoint.restore == "deepspeed_ext",
               fingerprints=ext.universal_checkpoint.fingerprints)
    _wait_at_exit()
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


def _hook_save(engine: Any, info: UCInfo, fingerprints: str, in_background: bool = False) -> None:
    """``save_checkpoint`` that writes our UC info (layouts, model config, fingerprints) into the tag and commits
    the tag with a marker (:mod:`deepspeed_ext.checkpoint.commit`).

    DeepSpeed writes the tag into a staging directory beside it; each rank's files are written to a temporary
    name, fsynced and renamed. When every rank's writes succeeded (the ranks agree on that, so a rank whose disk
    filled up makes every rank raise the one reason instead of leaving the others waiting), one rank writes the
    marker last, moves the tag into place in one rename (an existing tag of the same name is swapped out: it
    stays valid until then) and only then writes ``latest``. A kill at any instant leaves the tag either as it
    was or complete.

    On a CPU engine with DeepSpeed's own torch checkpoint engine, its files are written by
    :mod:`deepspeed_ext.checkpoint.zipsave`: the same bytes, each storage read once, in cached blocks, and the
    fingerprints' sums read each state from those blocks as they are written (see :func:`_guarded_writes`).
    Otherwise the sums run on a thread while DeepSpeed writes. Then rank 0 gathers the ranks' sums and adds them up. A
    checkpoint engine that commits later (decoupled, asynchronous) writes ``latest`` at its own commit: there the
    sums run first, the UC info is written before DeepSpeed's files, and the tag gets no marker (it is read as a
    checkpoint not saved by deepspeed-ext: docs/reliability.md).

    With ``in_background`` (``"async_save": true``) the files, the fingerprints, the marker and ``latest`` are
    written by a forked writer per rank (:func:`_save_in_background`)."""
    original = engine.save_checkpoint
    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_checkpoint(save_dir, tag=None, *args, **kwargs):
        from deepspeed_ext.checkpoint import commit, faults
        if tag is None:
            tag = f"global_step{engine.global_steps}"  # DeepSpeed's own default, made explicit
        tag = str(tag)
        call = signature.bind(save_dir, tag, *args, **kwargs)
        if engine_private.saves_in_background(engine):
            if fingerprints != "off":  # collective: every rank saves
                info.fingerprints = _save_fingerprints(engine, _local_sums(engine))
            info.commit_marker = False
            _write_info(engine, info, os.path.join(save_dir, tag))
            return original(*call.args, **call.kwargs)
        save_latest = bool(call.arguments.get("save_latest", True))
        call.arguments["save_latest"] = False
        coordinator = _is_commit_coordinator(engine)
        this_in_background = getattr(engine, ASYNC_SAVE_ATTR, False)  # switchable per save
        if hasattr(engine, PENDING_ATTR):
            settle_background_save(engine, block=True)  # one save at a time: the previous one is committed first
        faults.current_tag = tag
        problem = None
        if coordinator:
            try:
                commit.prepare_staging(save_dir, tag)
            except OSError as exc:
                problem = f"{commit.staging_root(save_dir, tag)}: cannot create the staging directory: {exc}"
        _raise_if_any_rank_failed(problem, tag, save_dir)
        call.arguments["save_dir"] = str(commit.staging_root(save_dir, tag))
        if this_in_background:
            return _save_in_background(engine, info, fingerprints, original, call, str(save_dir), tag, save_latest,
                                       coordinator)
        fuse = _can_fuse(engine)
        plan = sums = None
        if fingerprints != "off":
            if fuse:
                from deepspeed_ext.checkpoint.engine_fingerprints import SumsPlan
                plan = SumsPlan(engine)
            else:
                sums = _SumsThread(engine)
        failures: list[str] = []
        try:
            with _guarded_writes(engine, plan, failures, zipsave_files=fuse):
                result = original(*call.args, **call.kwargs)
        finally:
            if sums is not None:
                sums.join()
        faults.reached("files-written")
        _raise_if_any_rank_failed(failures[0] if failures else None, tag, save_dir, discard=coordinator)
        if fingerprints != "off":
            local = plan.finish() if plan is not None else sums.result()  # type: ignore[union-attr]
            info.fingerprints = _save_fingerprints(engine, local)
        problem = None
        if coordinator:
            try:
                _commit_save(engine, info, save_dir, tag, _commit_details(engine), save_latest)
            except (OSError, DeepSpeedExtError) as exc:
                problem = f"committing {tag}: {exc}"
        _raise_if_any_rank_failed(problem, tag, save_dir, discard=coordinator)
        return result

    engine.save_checkpoint = save_checkpoint
    setattr(engine, ASYNC_SAVE_ATTR, in_background)
    if in_background:
        _hook_steps_to_report_background_saves(engine)


def _commit_save(engine: Any, info: UCInfo, save_dir: str, tag: str, details: dict[str, Any],
                 save_latest: bool) -> None:
    """The coordinator's part of a save whose files every rank wrote: the UC info, then the commit."""
    from deepspeed_ext.checkpoint import commit
    info.commit_marker = True
    _write_info(engine, info, os.path.join(commit.staging_root(save_dir, tag), tag), always=True)
    commit.commit(save_dir, tag, details, save_latest=save_latest)


# --------------------------------------------------------------------------- asynchronous saves

#: Whether the engine's next ``save_checkpoint`` is written in the background: ``async_save`` from the config,
#: switchable per save (False: this save is written before it returns, as without ``async_save``).
ASYNC_SAVE_ATTR = "deepspeed_ext_async_save"
#: The engine's save being written in the background (a :class:`~.background.BackgroundSave`), until reported.
PENDING_ATTR = "deepspeed_ext_background_save"
#: Every save of this process still being written, for the exit (:func:`_wait_at_exit`).
_PENDING: list[Any] = []
#: The engines that save in the background (for Accelerate's ``save_state``, which waits for them).
_BACKGROUND_ENGINES: weakref.WeakSet[Any] = weakref.WeakSet()


def _can_save_in_background(engine: Any) -> bool:
    """Where ``async_save`` is honoured: a CPU engine (the fork is the snapshot; an accelerator's memory is not
    the host's, and a forked child cannot use the accelerator) whose checkpoint engine writes when asked (not
    DeepSpeed's decoupled one, which commits on its own). Elsewhere the save stays synchronous, with a warning."""
    reason = None
    if not hasattr(os, "fork"):
        reason = "this platform cannot fork"
    elif _device_type(getattr(engine, "device", None)) != "cpu":
        reason = "the engine runs on an accelerator (only CPU engines save in the background so far)"
    elif engine_private.saves_in_background(engine):
        reason = "DeepSpeed's decoupled checkpoint engine writes in the background already"
    if reason is not None and engine.global_rank == 0:
        logger.warning("async_save: saving synchronously: %s", reason)
    return reason is None


def _save_in_background(engine: Any, info: UCInfo, fingerprints: str, original: Any, call: Any, save_dir: str,
                        tag: str, save_latest: bool, coordinator: bool) -> Any:
    """DeepSpeed's ``save_checkpoint`` with each file it writes (and its copy of the recovery scripts) handed
    over instead of written; then a fork per rank (:mod:`~deepspeed_ext.checkpoint.background`) writes them from
    the state as it was, and the coordinator's writer commits once every rank's files are durable. Returns as
    soon as every rank has forked."""
    from deepspeed_ext.checkpoint import background, commit, faults
    from deepspeed_ext.checkpoint.engine_fingerprints import LocalSums
    files: list[tuple[Any, Any, str]] = []
    copies: list[tuple[Any, str]] = []

    def hand_over(own: Any) -> Any:
        def save(state_dict: Any, path: str) -> None:
            files.append((own, state_dict, path))
        return save

    def hand_over_copy(own: Any) -> Any:
        def copy(save_path: str) -> None:
            copies.append((own, save_path))
        return copy

    with engine_private.checkpoint_files_written_by(engine, hand_over), \
            engine_private.recovery_scripts_copied_by(engine, hand_over_copy):
        result = original(*call.args, **call.kwargs)
    staging = commit.staging_root(save_dir, tag)
    rank, fuse, details = engine.global_rank, _can_fuse(engine), _commit_details(engine)
    together = _ranks_committed_together(engine)

    def write_and_commit() -> None:  # in the forked writer: the state as it was at the fork
        torch.set_num_threads(1)  # the parent's OpenMP threads do not exist here
        background.note_writer(staging, rank)
        failures: list[str] = []
        local = None
        try:
            plan = None
            if fingerprints != "off" and fuse:
                from deepspeed_ext.checkpoint.engine_fingerprints import SumsPlan
                plan = SumsPlan(engine)
            releases = _released_once_written(files, plan) if fuse else [None] * len(files)
            for (own, state, path), written in zip(files, releases, strict=True):
                _guarded_save(own, plan, failures, fuse, state, path, written=written)
            for own, path in copies:
                _guarded_copy(own, failures, path)
            faults.reached("files-written")
            if not failures and fingerprints != "off":
                local = plan.finish() if plan is not None else _local_sums(engine)
        except Exception as exc:
            failures.append(first_line(exc))
        background.report_rank(staging, rank, failures[0] if failures else None,
                               {"sums": None if local is None else local.to_json()})
        if failures:
            raise background.BackgroundFailure(failures[0])
        if not coordinator:
            return
        words = background.wait_for_ranks(staging, together)
        if fingerprints != "off":
            from deepspeed_ext.checkpoint.engine_fingerprints import combine_local_sums
            info.fingerprints = _recorded_fingerprints(engine, *combine_local_sums(
                [LocalSums.from_json(words[each]["sums"]) for each in sorted(words)]))
        try:
            _commit_save(engine, info, save_dir, tag, details, save_latest)
        except (OSError, DeepSpeedExtError) as exc:
            raise background.BackgroundFailure(f"committing {tag}: {first_line(exc)}") from exc

    problem, pending = None, None
    try:
        pending = background.start(write_and_commit, tag=tag, save_dir=save_dir, staging=staging, rank=rank,
                                   coordinator=coordinator)
    except OSError as exc:  # no memory or no process left to fork
        problem = f"cannot start the background writer: {exc}"
    files.clear()  # the writer holds them now; the parent lets go of DeepSpeed's temporaries
    try:
        _raise_if_any_rank_failed(problem, tag, save_dir, discard=coordinator)
    except CheckpointError:
        if pending is not None:
            pending.kill()
        raise
    setattr(engine, PENDING_ATTR, pending)
    _PENDING.append(pending)
    return result


def _released_once_written(files: list[tuple[Any, Any, str]], plan: Any) -> list[Any]:
    """For a forked writer's zipsave, one per file: what gives each block of the file back to the kernel once it is
    written, but for what a later file or the sums still to be done (``plan``) read. Nothing is given back where
    a file's storages cannot be found (a file torch cannot pickle fails in its own write)."""
    from deepspeed_ext.checkpoint import background, zipsave
    try:
        spans = [zipsave.storage_ranges(state) for _, state, _ in files]
    except Exception:  # noqa: BLE001
        return [None] * len(files)
    later: list[list[tuple[int, int]]] = [[] for _ in files]
    for index in range(len(files) - 2, -1, -1):
        later[index] = later[index + 1] + spans[index + 1]
    return [background.ReleasedPages(
        lambda kept=kept: kept + (plan.unread_ranges() if plan is not None else [])) for kept in later]


def _ranks_committed_together(engine: Any) -> int:
    """How many ranks' writers the coordinator waits for: every rank, or the node's where each node commits its
    own files (node-local storage)."""
    if bool(getattr(engine, "use_node_local_storage", lambda: False)()):
        return int(os.environ.get("LOCAL_WORLD_SIZE", _world_size()))
    return _world_size()


def settle_background_save(engine: Any, block: bool) -> None:
    """Collective: where the engine has a save in the background, find out how it went (waiting for it with
    ``block``) and agree on it. Committed: forgotten, and what waited for the commit (a trainer's rotation of its
    old checkpoints) runs. Failed on any rank: every rank stops its writer, the coordinator removes the
    unfinished save, and every rank raises the failure in one line (naming the rank whose write failed first;
    ``latest`` never moved). Still running (not ``block``): kept, asked again at the next step."""
    from deepspeed_ext.checkpoint import collective, commit
    pending = getattr(engine, PENDING_ATTR, None)
    if pending is None:
        return
    outcome = pending.wait() if block else pending.poll()
    published = False
    if outcome is not None and not outcome.ok and pending.coordinator:
        published = _published_before_it_died(pending)
        if published and _read_text(os.path.join(pending.save_dir, "latest")) == pending.tag:
            logger.warning("the writer of %s died after committing it (%s); its leftovers are removed", pending.tag,
                           outcome.message)
            commit.discard_staging(pending.save_dir, pending.tag)
            outcome, published = type(outcome)(True), False
    problem = None if outcome is None or outcome.ok else outcome.message or "failed"
    gathered = collective.gather(problem, (outcome is not None, bool(outcome and outcome.relayed), published))
    failed = [(rank, text, relayed) for rank, (text, (_, relayed, _)) in enumerate(gathered) if text is not None]
    if not failed and not all(done for _, (done, _, _) in gathered):
        return
    delattr(engine, PENDING_ATTR)
    _PENDING.remove(pending)
    if failed:
        pending.kill()  # a writer still at work on a save that cannot be committed
        if pending.coordinator:
            commit.discard_staging(pending.save_dir, pending.tag)
        # A coordinator that gave up because another rank failed names that rank, whose own line says why.
        first_hand = [(rank, text) for rank, text, relayed in failed if not relayed]
        raise CheckpointError(_save_failure(first_hand or [(rank, text) for rank, text, _ in failed], pending.tag,
                                            pending.save_dir, "in the background ",
                                            published=any(flag for _, (_, _, flag) in gathered)))
    if pending.coordinator:
        logger.info("committed %s in the background, %.1f s after save_checkpoint returned", pending.tag,
                    time.monotonic() - pending.started)
    for action in pending.after_commit:
        action()


def _published_before_it_died(pending: Any) -> bool:
    """Whether the coordinator's writer had moved the tag into place (committed) before it failed or died: its
    staging directory no longer holds the tag, and the tag in the save directory is complete."""
    from deepspeed_ext.checkpoint import commit
    staging = commit.staging_root(pending.save_dir, pending.tag)
    final = Path(pending.save_dir) / pending.tag
    if not (staging.is_dir() and not (staging / pending.tag).exists() and final.is_dir()):
        return False
    status = commit.tag_status(final)
    return status.state is commit.TagState.COMMITTED and status.complete


def wait_for_saves(engine: Any) -> None:
    """Collective: wait until the engine's save in the background is committed; raises its failure (one line)."""
    settle_background_save(engine, block=True)


def _hook_steps_to_report_background_saves(engine: Any) -> None:
    """Each training step (``train_batch`` of a pipeline engine) first asks how a save in the background went
    (:func:`settle_background_save`, without waiting), so that a failure stops training at the next step;
    ``destroy`` waits for it (and ``load_checkpoint``: :func:`_hook_load`); the process's exit waits for every
    one (:func:`_wait_at_exit`)."""
    _BACKGROUND_ENGINES.add(engine)
    name = "train_batch" if engine_private.engine_is_pipeline(engine) else "step"
    for method in (name, "destroy"):
        own = getattr(engine, method, None)
        if own is None:
            continue
        block = method != name

        def reporting(*args: Any, _own: Any = own, _block: bool = block, **kwargs: Any) -> Any:
            settle_background_save(engine, block=_block)
            return _own(*args, **kwargs)

        setattr(engine, method, functools.wraps(own)(reporting))
    _wait_at_exit()


def _wait_at_exit() -> None:
    """:func:`_at_exit` at the process's exit (registered once)."""
    global _EXIT_WAIT_INSTALLED
    if not _EXIT_WAIT_INSTALLED:
        import atexit
        atexit.register(_at_exit)
        _EXIT_WAIT_INSTALLED = True


def _at_exit() -> None:
    """What a training process leaves running is ended before the interpreter tears itself down: the saves still
    being written in the background are waited for, then the default process group, if the script left it up, is
    destroyed. Left to the interpreter's teardown, a process group's C++ threads can be destroyed while still
    joinable, and the process aborts (SIGABRT, "terminate called without an active exception") after its work was
    done and committed: a job script would see a failed run. (atexit runs this before the interpreter finalizes;
    a script that destroys its process group itself is left as it is.)"""
    finish_background_saves()
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # at exit: say it, never raise
            logger.warning("could not destroy the process group at exit: %s", exc)


_EXIT_WAIT_INSTALLED = False


def finish_background_saves() -> None:
    """Wait for every save of this process still being written in the background, and say what became of each:
    committed, or not and why (a log line; no collective: each rank waits for its own writer). Runs at exit; a
    script that leaves by ``os._exit`` calls it first."""
    for pending in list(_PENDING):
        if pending.poll() is None:
            logger.info("waiting for the save of %s in the background to finish before exiting", pending.tag)
        outcome = pending.wait()
        _PENDING.remove(pending)
        if not outcome.ok:
            logger.error("the save of %s into %s in the background was not committed: %s", pending.tag,
                         pending.save_dir, outcome.message)
        elif pending.coordinator:
            logger.info("committed %s in the background", pending.tag)
            for action in pending.after_commit:
                action()


def _is_commit_coordinator(engine: Any) -> bool:
    """The rank that prepares and commits a save: global rank 0, or each node's first rank where DeepSpeed keeps
    checkpoints on node-local storage (each node then commits the files it holds)."""
    node_local = bool(getattr(engine, "use_node_local_storage", lambda: False)())
    return (engine.local_rank if node_local else engine.global_rank) == 0


def _commit_details(engine: Any) -> dict[str, Any]:
    """What the commit marker records beside the files: who wrote it and at which degrees."""
    tp_size, _ = engine_private.model_parallel_info(engine)
    world = _world_size()
    return {"global_steps": int(engine.global_steps), "world_size": world, "tp_degree": tp_size,
            "zero_stage": engine_private.zero_stage(engine), "written_by": _versions()}


def _world_size() -> int:
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _raise_if_any_rank_failed(problem: str | None, tag: str, save_dir: str, discard: bool = False) -> None:
    """Collective: every rank says whether its part of the save failed; if any did, every rank raises the first
    failure (one line, naming the rank and the file), and the coordinator removes the unfinished save. Doubles
    as the barrier between the save's steps."""
    from deepspeed_ext.checkpoint import collective, commit
    from deepspeed_ext.errors import CheckpointError
    failed = [(rank, text) for rank, (text, _) in enumerate(collective.gather(problem)) if text is not None]
    if not failed:
        return
    if discard:
        commit.discard_staging(save_dir, tag)
    raise CheckpointError(_save_failure(failed, tag, save_dir))


def _save_failure(failed: list[tuple[int, str]], tag: str, save_dir: str, how: str = "",
                  published: bool = False) -> str:
    """One line: the save of ``tag`` failed, on which rank(s) and why, and what ``latest`` still names
    (``published``: the tag itself was committed in place before the failure, only ``latest`` not moved)."""
    rank, text = failed[0]
    others = f" (and on {len(failed) - 1} other rank(s))" if len(failed) > 1 else ""
    latest = os.path.join(save_dir, "latest")
    kept = f"; {latest} still names {_read_text(latest)!r}" if os.path.isfile(latest) else ""
    what = (f"{os.path.join(save_dir, tag)} was committed (complete; load it by its tag) but latest was not moved"
            if published else "nothing of it was committed")
    return f"saving checkpoint {tag!r} into {save_dir} {how}failed on rank {rank}{others}: {text}; {what}{kept}"


def _read_text(path: str) -> str:
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return "?"


def _write_info(engine: Any, info: UCInfo, tag_dir: str, always: bool = False) -> None:
    if always or engine.global_rank == 0:
        info.optimizer_param_names = engine_private.stage0_param_names(engine)
        write_uc_info(tag_dir, info)


def _barrier() -> None:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _can_fuse(engine: Any) -> bool:
    """Whether DeepSpeed's files can be written by :mod:`~deepspeed_ext.checkpoint.zipsave` (the sums read
    from its blocks): its own torch checkpoint engine (the zip format) on a CPU engine. On an accelerator the
    sums run there and torch.save copies each storage to the host anyway."""
    from deepspeed_ext.checkpoint import zipsave
    return (engine_private.writes_torch_zip_files(engine) and _device_type(getattr(engine, "device", None)) == "cpu"
            and zipsave.supported())


def _device_type(device: Any) -> str:
    """``device``'s type ("cpu", "cuda", ...), whether it is a torch.device, a string or an index."""
    try:
        return torch.device(device).type
    except (TypeError, RuntimeError):
        return "cpu" if device is None else "other"


#: A file system with less room than this after a failed write was full (torch's writer reports ENOSPC as an
#: iostream error without the cause).
_NEARLY_FULL_BYTES = 64 << 20


def _write_failure(path: str, exc: BaseException) -> str:
    """Why writing ``path`` failed, in one line, with the cause where torch's message hides it (a full disk)."""
    from deepspeed_ext.errors import first_line
    message = first_line(exc)
    try:
        stats = os.statvfs(os.path.dirname(os.path.abspath(path)))
    except OSError:
        return message
    free = stats.f_bavail * stats.f_frsize
    if free < _NEARLY_FULL_BYTES and "No space left" not in message:
        message = f"No space left on device ({free} bytes free): {message}"
    return message


def _guarded_writes(engine: Any, plan: Any, failures: list[str], zipsave_files: bool) -> Any:
    """The engine's checkpoint writes (and its copy of the recovery scripts) replaced, for one ``save_checkpoint``,
    by :func:`_guarded_save` and :func:`_guarded_copy`: a save that is durable (fsynced) when it returns and
    never raises, so that every rank reaches DeepSpeed's own barrier and the ranks can then agree that the save
    failed (:func:`_raise_if_any_rank_failed`)."""
    stack = contextlib.ExitStack()
    stack.enter_context(engine_private.checkpoint_files_written_by(
        engine, lambda own: functools.partial(_guarded_save, own, plan, failures, zipsave_files)))
    stack.enter_context(engine_private.recovery_scripts_copied_by(
        engine, lambda own: functools.partial(_guarded_copy, own, failures)))
    return stack


def _guarded_save(own: Any, plan: Any, failures: list[str], zipsave_files: bool, state_dict: Any, path: str,
                  written: Any = None) -> None:
    """Write one of DeepSpeed's files durably, never raising: a failed write (a full disk) is recorded in
    ``failures``, its file removed, and the rest of this rank's files skipped. With ``zipsave_files`` the file is
    written by zipsave, which shows ``plan`` (the fingerprints' sums, when not None) each storage's blocks as they
    are written; where zipsave cannot (another torch), ``own`` (the checkpoint engine's save) writes it and what
    ``plan`` summed from it is forgotten. ``written``: zipsave's, told each block once it is in the file."""
    from deepspeed_ext.checkpoint import durable, zipsave
    if failures:
        return  # this rank's save has failed already: it will not be committed
    try:
        if zipsave_files:
            mark = plan.mark() if plan is not None else None
            zipsave.save(state_dict, path, plan,
                         on_fallback=(lambda: plan.rollback(mark)) if plan is not None else None, written=written)
        else:
            own(state_dict, path)
            if os.path.isfile(path):
                durable.fsync_file(path)
    except Exception as exc:  # a failed write: reported by every rank after DeepSpeed's barrier
        failures.append(f"{path}: {_write_failure(path, exc)}")
        with contextlib.suppress(OSError):
            os.unlink(path)


def _guarded_copy(own: Any, failures: list[str], save_path: str) -> None:
    """DeepSpeed's copy of its recovery scripts (``zero_to_fp32.py``), a write past its checkpoint engine, by
    ``own``; a failure recorded in ``failures`` as :func:`_guarded_save` does."""
    from deepspeed_ext.checkpoint import faults
    if failures:
        return
    try:
        faults.reached("recovery-scripts")
        own(save_path)
    except OSError as exc:
        path = str(exc.filename2 or exc.filename or save_path)
        failures.append(f"{path}: {_write_failure(path, exc)}")


class _SumsThread:
    """This rank's fingerprint sums, computed on a thread (torch's kernels release the GIL)."""

    def __init__(self, engine: Any):
        import threading
        self._local: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(engine, ), name="deepspeed-ext-fingerprints",
                                        daemon=True)
        self._thread.start()

    def _run(self, engine: Any) -> None:
        try:
            self._local = _local_sums(engine)
        except BaseException as exc:  # handed to the caller, which re-raises it on its own thread
            self._error = exc

    def join(self) -> None:
        self._thread.join()

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._local


def _local_sums(engine: Any) -> Any:
    from deepspeed_ext.checkpoint.engine_fingerprints import local_engine_sums
    return local_engine_sums(engine)


def _save_fingerprints(engine: Any, local: Any) -> Any:
    """The fingerprints from this rank's sums (collective: every rank saves)."""
    from deepspeed_ext.checkpoint.engine_fingerprints import reduce_engine_sums
    return _recorded_fingerprints(engine, *reduce_engine_sums(local))


def _recorded_fingerprints(engine: Any, found: Any, problems: list[str]) -> Any:
    """``found``, with a warning where the ranks disagree (``problems``)."""
    if problems and engine.global_rank == 0:
        logger.warning("saving a training state that is not consistent across ranks: %s", "; ".join(problems))
    return found


def _hook_load(engine: Any, reshard: bool, fingerprints: str) -> None:
    """``load_checkpoint`` through our restore where it reshards (``reshard``), and checked against the
    checkpoint's resume fingerprints afterwards whoever loaded it (unless ``fingerprints`` is "off")."""
    from deepspeed_ext.checkpoint.collective import on_every_rank
    original = engine.load_checkpoint
    signature = inspect.signature(original)

    def load(*args: Any, **kwargs: Any) -> Any:
        settle_background_save(engine, block=True)  # a save still being written is committed (or fails) first
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        options = call.arguments

        def checked_route() -> Any:
            refuse_incomplete(options["load_dir"], options.get("tag"))
            return _load_route(engine, options["load_dir"], options.get("tag")) if reshard else None

        # Collective: a rank that refuses the checkpoint (or fails in our restore) is heard by every rank, which
        # all raise the same line, before any goes on to a collective (DeepSpeed's loader, the fingerprint
        # check, the next training step) and waits there for it. DeepSpeed's own loader is left as it is.
        route = on_every_rank(checked_route)
        if options.get("custom_load_fn") is not None or route is None:
            return original(*args, **kwargs), options
        return on_every_rank(lambda: route(engine,
                                           options["load_dir"],
                                           options.get("tag"),
                                           load_optimizer_states=options.get("load_optimizer_states", True),
                                           load_lr_scheduler_states=options.get("load_lr_scheduler_states", True),
                                           load_module_only=options.get("load_module_only", False))), options

    @functools.wraps(original)
    def load_checkpoint(*args, **kwargs):
        result, options = load(*args, **kwargs)
        if fingerprints != "off":
            check_resume_fingerprints(engine, result[0] if result else None,
                                      with_optimizer=(bool(options.get("load_optimizer_states", True))
                                                      and not options.get("load_module_only", False)),
                                      on_mismatch=fingerprints)
        return result

    engine.load_checkpoint = load_checkpoint


def refuse_incomplete(load_dir: str | os.PathLike[str], tag: Any = None) -> None:
    """Raise :class:`~deepspeed_ext.errors.CheckpointError` (one line) where ``load_checkpoint(load_dir, tag)``
    would read a DeepSpeed tag whose save did not finish, or whose files disagree with its commit marker.
    DeepSpeed's own loader would read such a tag as if whole (an explicit ``tag``), or load nothing and go on
    training from scratch (a save directory whose only save never finished)."""
    from deepspeed_ext.checkpoint import commit
    from deepspeed_ext.checkpoint.locate import LATEST, ZERO_DIR
    from deepspeed_ext.errors import CheckpointError
    path = Path(load_dir)
    if tag is None:
        latest = path / LATEST
        if not latest.is_file():
            message = commit.unfinished_save_message(path)
            if message is not None:
                raise CheckpointError(message)
            return
        tag = latest.read_text().strip()
    tag_dir = path / str(tag)
    if not tag_dir.is_dir():
        message = commit.unfinished_save_message(path, str(tag))
        if message is not None:
            raise CheckpointError(message)
        return  # DeepSpeed says what is missing
    if not (tag_dir / ZERO_DIR).is_dir():
        commit.require_complete(tag_dir)


def check_resume_fingerprints(engine: Any, load_path: str | os.PathLike[str] | None, *, with_optimizer: bool = True,
                              on_mismatch: str = "error") -> bool | None:
    """Compare the live engine's training state with the fingerprints recorded in the checkpoint it loaded from
    (``load_path``: the tag directory or a file in it, as ``load_checkpoint`` returns it).

    Collective: every rank calls it, and every rank reaches the same verdict. Returns True on a match, False
    on a mismatch logged as a warning (``on_mismatch="warn"``), None when nothing could be checked; raises
    :class:`~deepspeed_ext.errors.CheckpointError` naming the parameters and states on a mismatch otherwise.
    """
    from deepspeed_ext.checkpoint.engine_fingerprints import engine_fingerprints
    from deepspeed_ext.checkpoint.expert_names import has_autoep_names, model_named_fingerprints
    from deepspeed_ext.checkpoint.fingerprint import compare, mismatch_message
    from deepspeed_ext.checkpoint.metadata import read_uc_info
    from deepspeed_ext.checkpoint.states import MODULE_WEIGHTS
    from deepspeed_ext.errors import CheckpointError
    if load_path is None:
        return None
    directory = Path(load_path)
    directory = directory if directory.is_dir() else directory.parent
    info = read_uc_info(directory)
    recorded = info.fingerprints if info is not None else None
    rank0 = engine.global_rank == 0
    if recorded is None:
        if rank0:
            logger.info("%s records no resume fingerprints; the restored state is not checked", directory)
        return None
    if not with_optimizer:
        # Without the optimizer's states DeepSpeed rebuilds the fp32 masters from the low-precision weights:
        # nothing saved is there to compare.
        if rank0:
            logger.info("optimizer states not loaded from %s; resume fingerprints not checked", directory)
        return None
    started = time.perf_counter()
    recorded_states = {state for states in recorded.tensors.values() for state in states} - {MODULE_WEIGHTS}
    found, problems = engine_fingerprints(engine, with_moments=len(recorded_states) > 1)
    if has_autoep_names(found.tensors) and not has_autoep_names(recorded.tensors):
        found = model_named_fingerprints(found)  # an AutoEP engine resumed from the model's names (from-hf)
    checked, mismatches = compare(recorded, found)
    elapsed = time.perf_counter() - started
    if not mismatches and not problems:
        if rank0:
            logger.info("resume fingerprints match: %d states of %d parameters and the steps, from %s (%.2f s)",
                        checked, len(recorded.tensors), directory, elapsed)
        return True
    message = mismatch_message(str(directory), mismatches, checked)
    if problems:
        message = f"{message}; {'; '.join(problems)}" if mismatches else f"{directory}: {'; '.join(problems)}"
    if on_mismatch == "error":
        raise CheckpointError(message)
    if rank0:
        logger.warning("%s", message)
    return False


def _load_route(engine: Any, load_dir: str, tag: str | None) -> Any:
    """Which restore serves ``load_checkpoint(load_dir, tag)``; None: DeepSpeed's own.

    * a universal checkpoint: ours, at any TP/DP degree. With ``load_universal`` off too when nothing else is
      there to load (a save directory with only ``latest_universal``, as ``-o`` writes, or a universal tag):
      DeepSpeed would find no ``latest`` and silently load nothing;
    * a regular DeepSpeed checkpoint saved at other TP/DP degrees (or with ``load_universal`` set): read
      directly, resharding at load time, no conversion step;
    * a regular checkpoint at the engine's own degrees: DeepSpeed's native loader (it is already exact).
    """
    from deepspeed_ext.checkpoint import restore, serialization
    from deepspeed_ext.checkpoint.deepspeed import keys
    from deepspeed_ext.checkpoint.deepspeed.files import resolve_tag_dir
    from deepspeed_ext.checkpoint.locate import LATEST, ZERO_DIR, holds_universal
    from deepspeed_ext.errors import CheckpointError
    only_universal = not (Path(load_dir) / LATEST).is_file() or engine.load_universal_checkpoint()
    if tag is None and only_universal and holds_universal(Path(load_dir)):
        return restore.load_universal_checkpoint
    try:
        tag_dir = resolve_tag_dir(load_dir, tag)
    except CheckpointError:
        if engine.load_universal_checkpoint():
            return restore.load_universal_checkpoint  # let it report what is missing
        return None
    if (tag_dir / ZERO_DIR).is_dir():
        return restore.load_universal_checkpoint
    if engine.load_universal_checkpoint():
        return restore.load_deepspeed_checkpoint
    model_files = sorted(tag_dir.glob(keys.MODEL_STATES_GLOB))
    if not model_files:
        return None
    saved = serialization.load(model_files[0])
    tp_size, _ = engine_private.model_parallel_info(engine)
    stages = engine_private.pipeline_stage(engine)[1]
    saved_stages = int((saved.get(keys.CHECKPOINT_PARALLEL_DIMS) or {}).get(keys.CHECKPOINT_PP_DEGREE, 1) or 1)
    dp_size = engine.dp_world_size if hasattr(engine, "dp_world_size") else None
    same = (int(saved.get(keys.MP_WORLD_SIZE) or 1) == tp_size * stages and saved_stages == stages
            and (dp_size is None or int(saved.get(keys.DP_WORLD_SIZE) or 1) == dp_size)
            and _saved_ep_size(saved) == _live_ep_size(engine)
            # DeepSpeed's loader reads ZeRO-3's per-rank model states only into ZeRO-3, and the reverse.
            and any(keys.ZERO3_MODEL_STATES_RE.match(p.name) for p in model_files)
            == engine_private.partitions_weights(engine))
    return None if same else restore.load_deepspeed_checkpoint


def _saved_ep_size(model_states: dict[str, Any]) -> int | None:
    """The AutoEP degree a checkpoint's model states record; None without AutoEP."""
    from deepspeed_ext.checkpoint.deepspeed.experts import AUTOEP_LAYERS
    layers = model_states.get(AUTOEP_LAYERS) or []
    sizes = {int(layer.get("ep_size", 1)) for layer in layers if isinstance(layer, dict)}
    return sizes.pop() if len(sizes) == 1 else (None if not sizes else -1)


def _live_ep_size(engine: Any) -> int | None:
    """The engine's AutoEP degree; None without AutoEP."""
    layers = engine_private.autoep_layers(engine.module)
    return layers[0].ep_size if layers else None
