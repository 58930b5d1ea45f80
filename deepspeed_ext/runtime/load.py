"""The load hook: ``load_checkpoint`` refuses a tag whose save did not finish, goes through our restore where it
must reshard (or read the universal form), and is checked against the checkpoint's resume fingerprints."""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

from deepspeed_ext.checkpoint import durable, engine_private
from deepspeed_ext.runtime.background_save import settle_background_save
from deepspeed_ext.runtime.fingerprints import check_resume_fingerprints


def hook_load(engine: Any, reshard: bool, fingerprints: str) -> None:
    """``load_checkpoint`` through our restore where it reshards (``reshard``), and checked against the
    checkpoint's resume fingerprints afterwards whoever loaded it (unless ``fingerprints`` is "off")."""
    engine_private.wrap_engine_method(engine, "load_checkpoint",
                                      lambda original: _checked_load(engine, reshard, fingerprints, original))


def _checked_load(engine: Any, reshard: bool, fingerprints: str, original: Any) -> Any:
    """The ``load_checkpoint`` :func:`hook_load` installs, around DeepSpeed's own (``original``)."""
    from deepspeed_ext.checkpoint.collective import on_every_rank
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
        if engine_private.node_local_storage(engine):
            route = _naming_node_local_storage(route)
        return on_every_rank(lambda: route(engine,
                                           options["load_dir"],
                                           options.get("tag"),
                                           load_optimizer_states=options.get("load_optimizer_states", True),
                                           load_lr_scheduler_states=options.get("load_lr_scheduler_states", True),
                                           load_module_only=options.get("load_module_only", False))), options

    def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
        result, options = load(*args, **kwargs)
        if fingerprints != "off":
            check_resume_fingerprints(engine, result[0] if result else None,
                                      with_optimizer=(bool(options.get("load_optimizer_states", True))
                                                      and not options.get("load_module_only", False)),
                                      on_mismatch=fingerprints)
        return result

    return load_checkpoint


def _naming_node_local_storage(route: Any) -> Any:
    """``route``, whose refusal of a checkpoint with files missing says why they may be: on node-local storage each
    node holds only its own ranks' files, which DeepSpeed's own loader reads at the saved degrees, while resharding
    (or ``load_universal``) reads every rank's."""
    from deepspeed_ext.errors import CheckpointError

    def reading_every_rank(*args: Any, **kwargs: Any) -> Any:
        try:
            return route(*args, **kwargs)
        except CheckpointError as exc:
            if "missing" not in str(exc):
                raise
            raise CheckpointError(f"{exc}; with node-local storage each node holds only its own ranks' files: resume "
                                  "at the degrees it was saved at with checkpoint.load_universal off, or gather every "
                                  "node's tag directory into one to reshard or convert it") from exc

    return reading_every_rank


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
        tag = durable.read_pointer(latest)
    tag_dir = path / str(tag)
    if not tag_dir.is_dir():
        message = commit.unfinished_save_message(path, str(tag))
        if message is not None:
            raise CheckpointError(message)
        return  # DeepSpeed says what is missing
    if not (tag_dir / ZERO_DIR).is_dir():
        commit.require_complete(tag_dir)


def _load_route(engine: Any, load_dir: str, tag: str | None) -> Any:
    """Which restore serves ``load_checkpoint(load_dir, tag)``; None: DeepSpeed's own.

    * a universal checkpoint: ours, at any TP/DP degree. With ``load_universal`` off too when nothing else is
      there to load (a save directory with only ``latest_universal``, as ``-o`` writes, or a universal tag):
      DeepSpeed would find no ``latest`` and silently load nothing;
    * a regular DeepSpeed checkpoint saved at other TP/DP degrees (or with ``load_universal`` set): read
      directly, resharding at load time, no conversion step;
    * a regular checkpoint at the engine's own degrees: DeepSpeed's native loader (it is already exact).
    """
    from deepspeed_ext.checkpoint import restore
    from deepspeed_ext.checkpoint.deepspeed.files import SavedDegrees, resolve_tag_dir
    from deepspeed_ext.checkpoint.locate import LATEST, ZERO_DIR, holds_universal
    from deepspeed_ext.errors import CheckpointError
    only_universal = not (Path(load_dir) / LATEST).is_file() or engine_private.loads_universal(engine)
    if tag is None and only_universal and holds_universal(Path(load_dir)):
        return restore.load_universal_checkpoint
    try:
        tag_dir = resolve_tag_dir(load_dir, tag)
    except CheckpointError:
        if engine_private.loads_universal(engine):
            return restore.load_universal_checkpoint  # let it report what is missing
        return None
    if (tag_dir / ZERO_DIR).is_dir():
        return restore.load_universal_checkpoint
    if engine_private.loads_universal(engine):
        return restore.load_deepspeed_checkpoint
    saved = SavedDegrees.read(tag_dir)
    if saved is None:
        return None
    tp_size, _ = engine_private.model_parallel_info(engine)
    stages = engine_private.pipeline_stage(engine)[1]
    dp_size = engine_private.data_parallel_size(engine)
    same = (saved.model_parallel == tp_size * stages and saved.pipeline == stages
            and (dp_size is None or saved.data_parallel == dp_size)
            and saved.expert_parallel == _live_ep_size(engine)
            # DeepSpeed's loader reads ZeRO-3's per-rank model states only into ZeRO-3, and the reverse.
            and saved.zero3_files == engine_private.partitions_weights(engine))
    return None if same else restore.load_deepspeed_checkpoint


def _live_ep_size(engine: Any) -> int | None:
    """The engine's AutoEP degree; None without AutoEP."""
    layers = engine_private.autoep_layers(engine.module)
    return layers[0].ep_size if layers else None
