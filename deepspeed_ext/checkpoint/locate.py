"""Where a checkpoint is, by names alone: each format's detection, the on-disk names it looks for, Trainer
``checkpoint-N`` folders, and ``--config`` files.

The format modules and the registry (:mod:`deepspeed_ext.checkpoint.formats`) both stand on this module, so no
format module needs the registry. Nothing here opens a tensor file or imports a heavy library.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from deepspeed_ext.checkpoint.deepspeed import keys
from deepspeed_ext.errors import CheckpointError

#: Each format's name in the registry (``SourceInfo.format``).
DEEPSPEED, UNIVERSAL, HUGGINGFACE, MAXTEXT = "deepspeed", "universal", "huggingface", "maxtext"
logger = logging.getLogger("deepspeed_ext")

# DeepSpeed's file names (its on-disk names all live in deepspeed/keys.py, which imports nothing heavy).
LATEST, LATEST_UNIVERSAL, ZERO_DIR = keys.LATEST, keys.LATEST_UNIVERSAL, keys.ZERO_DIR
ORBAX_METADATA = "_METADATA"
ORBAX_ITEM = "items"

#: What converting a universal checkpoint into the universal form is told instead.
ALREADY_UNIVERSAL = ("already a universal checkpoint: resume from it with \"checkpoint\": {\"load_universal\": "
                     "true}, or convert it with to-hf / to-maxtext")


def maxtext_root(items: Path) -> Path:
    """The directory of a MaxText output that its manifest sits in, from its Orbax item directory: the root of
    the checkpoint manager (``<root>/<step>/items``), else the step directory."""
    return items.parent.parent if items.parent.name.isdigit() else items.parent


def maxtext_items(path: Path) -> Path | None:
    """The Orbax item directory that ``path`` (item, step or root directory) designates, else None."""
    if (path / ORBAX_METADATA).is_file():
        return path
    if (path / ORBAX_ITEM / ORBAX_METADATA).is_file():
        return path / ORBAX_ITEM
    steps = [p for p in path.iterdir() if p.name.isdigit() and (p / ORBAX_ITEM / ORBAX_METADATA).is_file()]
    return max(steps, key=lambda p: int(p.name)) / ORBAX_ITEM if steps else None


#: A Hugging Face Trainer saves each checkpoint as ``<output_dir>/checkpoint-<global step>``.
TRAINER_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def newest_trainer_checkpoint(path: Path) -> Path | None:
    """The newest complete ``checkpoint-N`` in a Hugging Face Trainer ``output_dir`` (the highest N whose save
    finished), or None; each newer one whose save did not finish is skipped with a warning naming it."""
    chosen, skipped = trainer_checkpoints(path)
    for folder, reason in skipped:
        logger.warning("%s", f"skipping {folder}: {reason}")
    return chosen


def trainer_checkpoints(path: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(the newest complete ``checkpoint-N`` of a Trainer ``output_dir`` or None, the newer incomplete ones with
    why). The Trainer's own choice (``get_last_checkpoint``) takes the highest N, complete or not."""
    found = sorted(((int(m.group(1)), child) for child in path.iterdir()
                    if child.is_dir() and (m := TRAINER_CHECKPOINT_RE.match(child.name))), reverse=True)
    # The Trainer writes trainer_state.json last: where any checkpoint-N has one, one without it is unfinished.
    trainer = any((child / TRAINER_STATE).is_file() for _, child in found)
    skipped: list[tuple[Path, str]] = []
    for _, child in found:
        reason = incomplete_checkpoint_folder(child, trainer)
        if reason is None:
            return child, skipped
        skipped.append((child, reason))
    return None, skipped


def incomplete_checkpoint_folder(folder: Path, trainer: bool = True) -> str | None:
    """Why the Trainer ``checkpoint-N`` folder's save did not finish, or None when it did."""
    from deepspeed_ext.checkpoint import commit
    unfinished = commit.unfinished_saves(folder)
    if unfinished and not (folder / LATEST).is_file():
        return f"the DeepSpeed save of {', '.join(sorted(unfinished))} in it did not finish (killed mid-save?)"
    if trainer and not (folder / TRAINER_STATE).is_file():
        return f"the Trainer did not finish saving it (no {TRAINER_STATE}, which it writes last)"
    return None


#: What marks a Trainer checkpoint-N folder (beside the DeepSpeed save, config.json and tokenizer files).
TRAINER_STATE = "trainer_state.json"


def trainer_checkpoint_of(path: Path) -> Path | None:
    """The Trainer ``checkpoint-N`` folder that holds ``path`` (the folder itself, or a DeepSpeed or universal tag
    directory in it), or None."""
    for folder in (path, path.parent, path.parent.parent):
        if (folder / TRAINER_STATE).is_file():
            return folder
    return None


def has_deepspeed_files(path: Path) -> bool:
    return any(path.glob(keys.MODEL_STATES_GLOB)) or (path / LATEST).is_file()


def holds_universal(path: Path) -> bool:
    """A universal directory, or a save directory that names one (it may hold a DeepSpeed tag too)."""
    return (path / ZERO_DIR).is_dir() or (path / LATEST_UNIVERSAL).is_file()


def is_universal(path: Path) -> bool:
    # A universal directory holds copies of the model-states files too: zero/ decides. A save directory with
    # both 'latest' and 'latest_universal' is read as the DeepSpeed checkpoint it is (resuming with
    # load_universal reads the universal one: deepspeed_ext.runtime).
    return (path / ZERO_DIR).is_dir() or (holds_universal(path) and not has_deepspeed_files(path))


def is_deepspeed(path: Path) -> bool:
    return not (path / ZERO_DIR).is_dir() and has_deepspeed_files(path)


def is_huggingface(path: Path) -> bool:
    return any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file()


def is_maxtext(path: Path) -> bool:
    return maxtext_items(path) is not None


def read_config(config_path: str | Path) -> dict[str, Any]:
    """A model config (HF ``config.json``) given with ``--config``."""
    try:
        config = json.loads(Path(config_path).read_text())
    except FileNotFoundError as exc:
        raise CheckpointError(f"{config_path}: no such file (--config)") from exc
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{config_path}: cannot read a JSON model config: {exc}") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path}: not a JSON object (an HF config.json)")
    return config
