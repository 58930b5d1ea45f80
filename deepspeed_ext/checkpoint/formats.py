"""The format registry: which checkpoint format a path holds, and the module that reads (and writes) it.

Every command and the engine's load route find their input here. A format is one module with
``open_source(path, options) -> CheckpointSource`` and, if it can be written, ``write(source, out, options)``
and its options class; adding one is that module plus an entry in :data:`FORMATS`.

* **DeepSpeed** — a save directory (``latest`` names the tag) or a tag directory (``*model_states.pt``).
* **universal** — a universal directory (``zero/``) or a save directory whose ``latest_universal`` names one.
* **Hugging Face** — a model directory with ``*.safetensors`` (and ``config.json``, or ``--config``).
* **MaxText** — an Orbax checkpoint: the item directory (``_METADATA``), its step directory, or the root of the
  checkpoint manager (``<root>/<step>/items``, the highest step).

Detection looks at names only (no file is opened), so it is cheap and imports nothing heavy.
"""

from __future__ import annotations

import importlib
import json
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from deepspeed_ext.checkpoint.deepspeed import keys
from deepspeed_ext.checkpoint.source import CheckpointSource, OpenOptions
from deepspeed_ext.errors import CheckpointError

DEEPSPEED, UNIVERSAL, HUGGINGFACE, MAXTEXT = "deepspeed", "universal", "huggingface", "maxtext"
logger = logging.getLogger("deepspeed_ext")

# DeepSpeed's file names (its on-disk names all live in deepspeed/keys.py, which imports nothing heavy).
LATEST, LATEST_UNIVERSAL, ZERO_DIR = keys.LATEST, keys.LATEST_UNIVERSAL, keys.ZERO_DIR
ORBAX_METADATA = "_METADATA"
ORBAX_ITEM = "items"

#: What converting a universal checkpoint into the universal form is told instead.
ALREADY_UNIVERSAL = ("already a universal checkpoint: resume from it with \"checkpoint\": {\"load_universal\": "
                     "true}, or convert it with to-hf / to-maxtext")


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


def checkpoint_path(path: str | Path) -> Path:
    """``path`` itself, or, for a Trainer ``output_dir`` that is no checkpoint of its own, its newest complete
    ``checkpoint-N``."""
    path = Path(path)
    if path.is_dir() and not any(fmt.detect(path) for fmt in FORMATS.values()):
        return newest_trainer_checkpoint(path) or path
    return path


def _has_deepspeed_files(path: Path) -> bool:
    return any(path.glob(keys.MODEL_STATES_GLOB)) or (path / LATEST).is_file()


def holds_universal(path: Path) -> bool:
    """A universal directory, or a save directory that names one (it may hold a DeepSpeed tag too)."""
    return (path / ZERO_DIR).is_dir() or (path / LATEST_UNIVERSAL).is_file()


def _is_universal(path: Path) -> bool:
    # A universal directory holds copies of the model-states files too: zero/ decides. A save directory with
    # both 'latest' and 'latest_universal' is read as the DeepSpeed checkpoint it is (resuming with
    # load_universal reads the universal one: deepspeed_ext.runtime).
    return (path / ZERO_DIR).is_dir() or (holds_universal(path) and not _has_deepspeed_files(path))


def _is_deepspeed(path: Path) -> bool:
    return not (path / ZERO_DIR).is_dir() and _has_deepspeed_files(path)


def _is_huggingface(path: Path) -> bool:
    return any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file()


def _is_maxtext(path: Path) -> bool:
    return maxtext_items(path) is not None


@dataclass(frozen=True)
class Format:
    """One checkpoint format: how to recognise it and the module that reads and writes it."""

    name: str
    title: str
    detect: Callable[[Path], bool]
    #: The module with ``open_source`` (and ``write`` and :attr:`options`, when :attr:`options` is set).
    module: str
    #: The name of the writer's options class in :attr:`module`; None: deepspeed-ext does not write the format.
    options: str | None = None
    #: The install extra whose libraries reading and writing the format need (deepspeed_ext.extras); None: base.
    extra: str | None = None

    def load(self) -> ModuleType:
        if self.extra is not None:
            from deepspeed_ext import extras
            extras.require(self.extra, f"reading or writing {self.title} checkpoints")
        return importlib.import_module(self.module)

    def open(self, path: str | Path, options: OpenOptions) -> CheckpointSource:
        source: CheckpointSource = self.load().open_source(Path(path), options)
        return source

    def write_options(self, **values: Any) -> Any:
        if self.options is None:
            raise CheckpointError(f"deepspeed-ext reads {self.title} checkpoints but does not write them")
        cls = getattr(self.load(), self.options)
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(values) - known)
        if unknown:
            raise TypeError(f"unknown option(s) for writing {self.title}: {', '.join(unknown)} "
                            f"(known: {', '.join(sorted(known))})")
        return cls(**values)

    def write(self, source: CheckpointSource, out: str | Path | None, options: Any) -> Path:
        written: Path = self.load().write(source, out, options)
        return written


#: The most specific first: where a directory holds two (a Hugging Face Trainer checkpoint has the DeepSpeed
#: save beside the model's safetensors), the first is the default reading.
FORMATS: dict[str, Format] = {f.name: f for f in (
    Format(UNIVERSAL, "universal", _is_universal, "deepspeed_ext.checkpoint.universal", "UniversalOptions"),
    Format(DEEPSPEED, "DeepSpeed", _is_deepspeed, "deepspeed_ext.checkpoint.deepspeed"),
    Format(HUGGINGFACE, "Hugging Face", _is_huggingface, "deepspeed_ext.checkpoint.hf", "HFOptions", extra="hf"),
    Format(MAXTEXT, "MaxText (Orbax)", _is_maxtext, "deepspeed_ext.checkpoint.maxtext", "MaxTextOptions",
           extra="maxtext"),
)}

if TYPE_CHECKING:
    # The modules above are imported by name at run time, which a type checker cannot follow: here every
    # format's reader is checked against the contract, so one whose source lacks part of CheckpointSource (as
    # when ``inspect`` called a ``summary`` a reader did not have) is a type error. One entry per format.
    from deepspeed_ext.checkpoint import deepspeed, hf, maxtext, universal
    _READERS: dict[str, Callable[[Path, OpenOptions], CheckpointSource]] = {
        UNIVERSAL: universal.open_source, DEEPSPEED: deepspeed.open_source, HUGGINGFACE: hf.open_source,
        MAXTEXT: maxtext.open_source}

#: Output format names users may give (``convert(..., to=...)``), each a registry entry.
TARGETS = {"universal": UNIVERSAL, "hf": HUGGINGFACE, "huggingface": HUGGINGFACE, "maxtext": MAXTEXT}


def detect_all(path: str | Path, tag: str | None = None) -> list[str]:
    """Every format at ``path`` (a Trainer ``output_dir``: at its newest ``checkpoint-N``), the most specific
    first; one line naming the path and what is wrong with it when there is none."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not path.is_dir():
        hint = ("the model directory that holds it and config.json" if path.suffix == ".safetensors" else
                "the save directory or the tag directory that holds it" if path.suffix == ".pt" else
                "a checkpoint directory")
        raise CheckpointError(f"{path}: is a file, not a checkpoint directory; give {hint}")
    if tag is not None:
        return [UNIVERSAL if (path / tag / ZERO_DIR).is_dir() else DEEPSPEED]
    path = checkpoint_path(path)
    unfinished = _unfinished_save(path)
    if unfinished is not None:
        raise CheckpointError(unfinished)
    found = [name for name, fmt in FORMATS.items() if fmt.detect(path)]
    if found:
        return found
    if (path / "config.json").is_file():
        raise CheckpointError(f"{path}: has config.json but no *.safetensors weights (a Hugging Face checkpoint "
                              "needs them; .bin weights are not read, as they are pickles)")
    raise CheckpointError(f"{path}: not a checkpoint: neither a tag directory (DeepSpeed *model_states.pt, or "
                          "universal zero/) nor a save directory ('latest' or 'latest_universal'), nor Hugging Face "
                          f"*.safetensors, nor Orbax {ORBAX_METADATA}")


def _unfinished_save(path: Path) -> str | None:
    """One line when ``path`` holds only a DeepSpeed save that never finished (no ``latest``: nothing in it was
    committed), naming the newest complete Trainer checkpoint beside it where there is one."""
    from deepspeed_ext.checkpoint import commit
    if commit.is_staging(path):
        return commit.refusal(path)
    if not path.is_dir() or (path / LATEST).is_file() or _has_deepspeed_files(path):
        return None
    message = commit.unfinished_save_message(path)
    if message is None:
        return None
    if TRAINER_CHECKPOINT_RE.match(path.name):
        newest, _ = trainer_checkpoints(path.parent)
        message += f"; the newest complete checkpoint is {newest}" if newest is not None else \
            "; no checkpoint beside it is complete"
    return message


def detect(path: str | Path, tag: str | None = None) -> str:
    """The format at ``path`` (the most specific, where there are several)."""
    return detect_all(path, tag)[0]


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


def open_checkpoint(path: str | Path,
                    *,
                    tag: str | None = None,
                    config: str | Path | Mapping[str, Any] | None = None,
                    family: str | None = None,
                    dtype: str = "source",
                    format: str | None = None,
                    accept: Mapping[str, str] | None = None) -> CheckpointSource:
    """The source at ``path`` in whatever format it is (or in ``format``, where the directory holds several).

    ``config``: an HF config (a ``config.json`` path or its dict) to use instead of the recorded one, and for
    the formats that may lack one (HF weights without config.json, MaxText checkpoints not written by
    deepspeed-ext). ``family``: MaxText's model family. ``dtype``: the dtype HF weights are read in.
    ``accept``: the formats the caller reads, each mapped to nothing, and the others to the line it says when
    one of them is found instead.
    """
    found = detect_all(path, tag)
    if tag is None:
        path = checkpoint_path(path)
    if format is not None:
        if format not in FORMATS:
            raise CheckpointError(f"unknown format {format!r}; known: {', '.join(FORMATS)}")
        if format not in found:
            raise CheckpointError(f"{path}: not a {FORMATS[format].title} checkpoint (found: "
                                  f"{', '.join(FORMATS[f].title for f in found)})")
        found = [format]
    readable = [kind for kind in found if accept is None or not accept.get(kind)]
    if not readable:
        assert accept is not None
        raise CheckpointError(f"{path}: {accept[found[0]]}")
    model_config = read_config(config) if isinstance(config, str | Path) else dict(config) if config else None
    return FORMATS[readable[0]].open(path, OpenOptions(tag=tag, model_config=model_config, family=family,
                                                       dtype=dtype))
