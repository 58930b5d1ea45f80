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
import time
from pathlib import Path
from typing import Any

import torch

from deepspeed_ext.checkpoint.metadata import UCInfo, write_uc_info
from deepspeed_ext.config import ExtConfig, load_ds_config
from deepspeed_ext.errors import DeepSpeedExtError
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
    if ext.universal_checkpoint.enabled:
        refuse_autoep_with_incompatible_transformers(ds_config)
    result: tuple[Any, ...] = _deepspeed_initialize()(*args, **kwargs)
    if ext.universal_checkpoint.enabled:
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


def disable() -> None:
    """Undo :func:`enable`: ``deepspeed.initialize`` is DeepSpeed's own again (engines built meanwhile keep
    their hooks), and so is the Trainer's choice of the checkpoint to resume from."""
    import deepspeed
    deepspeed.initialize = _deepspeed_initialize()
    _trainer_resume_choice(install=False)


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
                  versions=_versions())
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
    _hook_save(engine, info, ext.universal_checkpoint.fingerprints)
    _hook_load(engine, reshard=ext.universal_checkpoint.restore == "deepspeed_ext",
               fingerprints=ext.universal_checkpoint.fingerprints)
    return info


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


def _hook_save(engine: Any, info: UCInfo, fingerprints: str) -> None:
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
    Otherwise the sums run on a thread while DeepSpeed writes. Then one all-reduce adds the ranks' sums up. A
    checkpoint engine that commits later (decoupled, asynchronous) writes ``latest`` at its own commit: there the
    sums run first, the UC info is written before DeepSpeed's files, and the tag gets no marker (it is read as a
    checkpoint not saved by deepspeed-ext: docs/reliability.md)."""
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
        faults.current_tag = tag
        problem = None
        if coordinator:
            try:
                commit.prepare_staging(save_dir, tag)
            except OSError as exc:
                problem = f"{commit.staging_root(save_dir, tag)}: cannot create the staging directory: {exc}"
        _raise_if_any_rank_failed(problem, tag, save_dir)
        call.arguments["save_dir"] = str(commit.staging_root(save_dir, tag))
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
                info.commit_marker = True
                _write_info(engine, info, os.path.join(commit.staging_root(save_dir, tag), tag), always=True)
                commit.commit(save_dir, tag, _commit_details(engine), save_latest=save_latest)
            except (OSError, DeepSpeedExtError) as exc:
                problem = f"committing {tag}: {exc}"
        _raise_if_any_rank_failed(problem, tag, save_dir, discard=coordinator)
        return result

    engine.save_checkpoint = save_checkpoint


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
    rank, text = failed[0]
    others = f" (and on {len(failed) - 1} other rank(s))" if len(failed) > 1 else ""
    latest = os.path.join(save_dir, "latest")
    kept = f"; {latest} still names {_read_text(latest)!r}" if os.path.isfile(latest) else ""
    raise CheckpointError(f"saving checkpoint {tag!r} into {save_dir} failed on rank {rank}{others}: {text}; nothing "
                          f"of it was committed{kept}")


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
    by a save that is durable (fsynced) when it returns and never raises: a failed write (a full disk) is recorded
    in ``failures``, its file removed, and the rest of this rank's files skipped, so that every rank reaches
    DeepSpeed's own barrier and the ranks can then agree that the save failed (:func:`_raise_if_any_rank_failed`).
    With ``zipsave_files`` the files are written by zipsave, which shows ``plan`` (the fingerprints' sums, when not
    None) each storage's blocks as they are written; where zipsave cannot (another torch), torch.save writes the
    file and what ``plan`` summed from it is forgotten."""
    from deepspeed_ext.checkpoint import durable, faults, zipsave

    def make_save(own: Any) -> Any:
        def save(state_dict: Any, path: str) -> None:
            if failures:
                return  # this rank's save has failed already: it will not be committed
            try:
                if zipsave_files:
                    mark = plan.mark() if plan is not None else None
                    zipsave.save(state_dict, path, plan,
                                 on_fallback=(lambda: plan.rollback(mark)) if plan is not None else None)
                else:
                    own(state_dict, path)
                    if os.path.isfile(path):
                        durable.fsync_file(path)
            except Exception as exc:  # a failed write: reported by every rank after DeepSpeed's barrier
                failures.append(f"{path}: {_write_failure(path, exc)}")
                with contextlib.suppress(OSError):
                    os.unlink(path)
        return save

    def make_copy(own: Any) -> Any:
        def copy(save_path: str) -> None:
            if failures:
                return
            try:
                faults.reached("recovery-scripts")
                own(save_path)
            except OSError as exc:  # DeepSpeed's recovery scripts, written past its checkpoint engine
                path = str(exc.filename2 or exc.filename or save_path)
                failures.append(f"{path}: {_write_failure(path, exc)}")
        return copy

    stack = contextlib.ExitStack()
    stack.enter_context(engine_private.checkpoint_files_written_by(engine, make_save))
    stack.enter_context(engine_private.recovery_scripts_copied_by(engine, make_copy))
    return stack


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
    found, problems = reduce_engine_sums(local)
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
    recorded_states = {state for states in recorded.tensors.values() for state in states}
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
