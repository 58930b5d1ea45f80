"""Transformers' and Accelerate's functions deepspeed-ext replaces, fenced: the one module that patches them.

:func:`enable` installs, and :func:`disable` removes, two changes to how the Hugging Face Trainer and Accelerate
handle checkpoints: the Trainer resumes from the newest *complete* ``checkpoint-N``, and neither deletes old
checkpoints while a save in the background is still being committed. :func:`check_installed_integrations`
names, in one line, any part of the installed transformers or Accelerate that is not what these patches expect,
before any is installed; a library that is not installed is left alone.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from deepspeed_ext.errors import DeepSpeedExtError
from deepspeed_ext.runtime.background_save import BACKGROUND_ENGINES, PENDING_SAVES, settle_background_save
from deepspeed_ext.runtime.log import logger

#: Marks a function deepspeed-ext installed in another library's place; holds the function it replaced.
WRAPPED_ATTR = "__deepspeed_ext_wraps__"

#: What the patches below use of each library: ``module -> ((attribute path, parameters it must take), ...)``.
_REQUIRED: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "transformers.trainer_utils": (
        ("get_last_checkpoint", ("folder", )),
        ("sort_checkpoints", ("output_dir", "checkpoint_prefix", "use_mtime")),
        # rotate_checkpoints is optional: older transformers rotate inside the Trainer, where no save waits
    ),
    "accelerate": (("Accelerator.save_state", ()), ),
}
_OPTIONAL: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "transformers.trainer_utils": (("rotate_checkpoints", ("output_dir", "save_total_limit", "best_model_checkpoint", "use_mtime",
                                                   "checkpoint_prefix")), ),
}


def _lookup(module: Any, path: str) -> Any:
    target = module
    for part in path.split("."):
        target = getattr(target, part, None)
        if target is None:
            return None
    return target


def missing_integration_parts() -> list[str]:
    """Each part of the installed transformers / Accelerate the patches use that is not there, in words."""
    missing = []
    for table, required in ((_REQUIRED, True), (_OPTIONAL, False)):
        for module_name, parts in table.items():
            if importlib.util.find_spec(module_name.partition(".")[0]) is None:
                continue
            module = importlib.import_module(module_name)
            for path, parameters in parts:
                found = _lookup(module, path)
                if found is None:
                    if required:
                        missing.append(f"{module_name}.{path}")
                    continue
                own = getattr(found, WRAPPED_ATTR, found)
                try:
                    taken = set(inspect.signature(own).parameters)
                except (TypeError, ValueError):
                    continue
                missing += [f"{module_name}.{path}'s parameter {name!r}" for name in parameters if name not in taken]
    return missing


def check_installed_integrations() -> None:
    """Raise :class:`DeepSpeedExtError` in one line where the installed transformers or Accelerate lacks what the
    patches replace (run by :func:`enable`, before it patches anything)."""
    missing = missing_integration_parts()
    if missing:
        raise DeepSpeedExtError(
            f"deepspeed-ext cannot patch this transformers/Accelerate: {'; '.join(missing[:3])} is missing "
            "(see 'Adding a DeepSpeed release' in docs/architecture.md: the integrations fence is "
            "deepspeed_ext/runtime/integrations.py)")


def install(install: bool) -> None:
    """Install (or with False remove) every patch of this module."""
    if install:
        check_installed_integrations()
    trainer_resume_choice(install)
    saves_wait_for_background_commits(install)


#: Marks the ``deepspeed.initialize`` that :func:`enable` installs; holds the function it wraps.
WRAPPED_ATTR = "__deepspeed_ext_wraps__"


def trainer_resume_choice(install: bool) -> None:
    """With ``install``: the Hugging Face Trainer's ``resume_from_checkpoint=True`` resumes from the newest
    *complete* ``checkpoint-N`` (transformers' ``get_last_checkpoint`` takes the highest N, even one whose save
    was killed half-way), skipping each newer one with a warning that names it. Without: transformers' own
    again. Nothing happens where transformers is not installed."""
    import importlib.util
    if importlib.util.find_spec("transformers") is None:
        return
    trainer_utils: Any = importlib.import_module("transformers.trainer_utils")
    current = trainer_utils.get_last_checkpoint
    own = getattr(current, WRAPPED_ATTR, current)
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

        setattr(get_last_checkpoint, WRAPPED_ATTR, own)
        replacement: Any = get_last_checkpoint
    elif not install:
        replacement = own
    else:
        return
    trainer_utils.get_last_checkpoint = replacement
    trainer: Any = sys.modules.get("transformers.trainer")  # imported the function by name already
    if trainer is not None and getattr(trainer, "get_last_checkpoint", None) in (current, own):
        trainer.get_last_checkpoint = replacement


def saves_wait_for_background_commits(install: bool) -> None:
    """With ``install``, where a save is written in the background (``async_save``):

    * the Hugging Face Trainer's rotation of its ``checkpoint-N`` folders (``save_total_limit``), which runs right
      after a save returns, waits for that save's commit: it runs then, on the next step that finds it committed
      (or at the exit), and not at all if the save failed. Run at once, it would delete the newest committed
      checkpoint while the one replacing it is still being written;
    * Accelerate's ``save_state``, which deletes its oldest folders (``total_limit``) before it saves, first waits
      for the save in the background to commit.

    Without: transformers' and Accelerate's own again. Nothing happens where they are not installed."""
    import importlib.util
    if importlib.util.find_spec("transformers") is not None:
        trainer_utils: Any = importlib.import_module("transformers.trainer_utils")
        current = getattr(trainer_utils, "rotate_checkpoints", None)
        if current is not None:
            own = getattr(current, WRAPPED_ATTR, current)
            replacement = own
            if install:
                @functools.wraps(own)
                def rotate_checkpoints(output_dir: Any, *args: Any, **kwargs: Any) -> Any:
                    inside = [pending for pending in PENDING_SAVES if _is_within(pending.save_dir, output_dir)]
                    if not inside:
                        return own(output_dir, *args, **kwargs)
                    inside[-1].after_commit.append(
                        functools.partial(_rotate_keeping_the_newest_complete, own, output_dir, *args, **kwargs))
                    logger.info("rotating the checkpoints of %s once %s is committed", output_dir, inside[-1].tag)
                    return None

                setattr(rotate_checkpoints, WRAPPED_ATTR, own)
                replacement = rotate_checkpoints
            trainer_utils.rotate_checkpoints = replacement
            trainer: Any = sys.modules.get("transformers.trainer")  # imported the function by name already
            if trainer is not None and getattr(trainer, "rotate_checkpoints", None) in (current, own):
                trainer.rotate_checkpoints = replacement
    if importlib.util.find_spec("accelerate") is not None:
        accelerator = importlib.import_module("accelerate").Accelerator
        current_save = accelerator.save_state
        own_save = getattr(current_save, WRAPPED_ATTR, current_save)
        if install and own_save is current_save:
            @functools.wraps(own_save)
            def save_state(self: Any, *args: Any, **kwargs: Any) -> Any:
                for engine in list(BACKGROUND_ENGINES):
                    settle_background_save(engine, block=True)
                return own_save(self, *args, **kwargs)

            setattr(save_state, WRAPPED_ATTR, own_save)
            accelerator.save_state = save_state
        elif not install:
            accelerator.save_state = own_save


def _rotate_keeping_the_newest_complete(own: Any, output_dir: Any, *args: Any, **kwargs: Any) -> Any:
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
