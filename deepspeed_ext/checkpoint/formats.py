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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from deepspeed_ext.checkpoint.locate import (DEEPSPEED, HUGGINGFACE, LATEST, MAXTEXT, ORBAX_METADATA,
                                             TRAINER_CHECKPOINT_RE, UNIVERSAL, ZERO_DIR, has_deepspeed_files,
                                             is_deepspeed, is_huggingface, is_maxtext, is_universal, maxtext_root,
                                             newest_trainer_checkpoint, read_config, trainer_checkpoints)
from deepspeed_ext.checkpoint.manifest import FilesChecked, manifest_files_checked
from deepspeed_ext.checkpoint.source import CheckpointSource, OpenOptions
from deepspeed_ext.errors import CheckpointError


def checkpoint_path(path: str | Path) -> Path:
    """``path`` itself, or, for a Trainer ``output_dir`` that is no checkpoint of its own, its newest complete
    ``checkpoint-N``."""
    path = Path(path)
    if path.is_dir() and not any(fmt.detect(path) for fmt in FORMATS.values()):
        return newest_trainer_checkpoint(path) or path
    return path


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
    # Hooks: what commands need to know of a format beyond reading and writing it. A new format sets the ones
    # that differ from the defaults; verify, compare and inspect never branch on a format's name.
    #: The format keeps whole tensors (no tensor-parallel layout to describe: ``inspect``).
    holds_full_tensors: bool = False
    #: The source hands its weights out wider than it stores them (MaxText's bf16 come back as fp32): ``compare``
    #: judges a difference at the stored precision.
    widens_weights: bool = False
    #: The name of a function in :attr:`module`, ``(source) -> FilesChecked``, that checks the files the
    #: format's own way (DeepSpeed: its commit marker or zip checksums); None: the manifest deepspeed-ext
    #: writes with every output, in the directory :attr:`files_root` gives.
    files_check: str | None = None
    #: Where an output's manifest is, from ``SourceInfo.path`` (MaxText: the checkpoint's root, above
    #: ``<step>/items``); None: that path itself.
    files_root: Callable[[Path], Path] | None = None
    #: The name of a function in :attr:`module`, ``(source) -> str | None``, saying how the parameters fail to
    #: fit the model the checkpoint's config describes (Hugging Face: transformers' model), for ``verify``.
    model_check: str | None = None
    #: The format names parameters as the model does (transformers' names): a source with DeepSpeed AutoEP's
    #: names is written under the model's (:mod:`~deepspeed_ext.checkpoint.expert_names`).
    model_names: bool = False
    #: The format's reader serves a live engine's restore (:class:`~deepspeed_ext.checkpoint.source.Reshards`).
    restores_engines: bool = False
    #: The command that turns a checkpoint of this format into one DeepSpeed resumes from (None: it is one), and
    #: the command that writes the format (None: deepspeed-ext does not): a command given a format it does not
    #: read names them (:func:`not_read`).
    imported_by: str | None = None
    written_by: str | None = None

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
        if self.model_names:
            from deepspeed_ext.checkpoint.expert_names import model_named
            source = model_named(source)
        written: Path = self.load().write(source, out, options)
        return written

    def check_files(self, source: CheckpointSource) -> FilesChecked:
        """``verify``'s check of the files (checksums, safe loading), whatever the format keeps for it."""
        if self.files_check is not None:
            checked: FilesChecked = getattr(self.load(), self.files_check)(source)
            return checked
        root = source.info.path if self.files_root is None else self.files_root(source.info.path)
        return manifest_files_checked(root)

    def check_model(self, source: CheckpointSource) -> str | None:
        """How ``source``'s parameters fail to fit its model (None: they fit, or the format has no such check)."""
        if self.model_check is None:
            return None
        problem: str | None = getattr(self.load(), self.model_check)(source)
        return problem


#: The most specific first: where a directory holds two (a Hugging Face Trainer checkpoint has the DeepSpeed
#: save beside the model's safetensors), the first is the default reading.
FORMATS: dict[str, Format] = {f.name: f for f in (
    Format(UNIVERSAL, "universal", is_universal, "deepspeed_ext.checkpoint.universal", "UniversalOptions",
           restores_engines=True, written_by="to-universal"),
    Format(DEEPSPEED, "DeepSpeed", is_deepspeed, "deepspeed_ext.checkpoint.deepspeed", files_check="check_files",
           restores_engines=True, imported_by="to-universal"),
    Format(HUGGINGFACE, "Hugging Face", is_huggingface, "deepspeed_ext.checkpoint.hf", "HFOptions", extra="hf",
           holds_full_tensors=True, model_check="parameter_problem", model_names=True, imported_by="from-hf",
           written_by="to-hf"),
    Format(MAXTEXT, "MaxText (Orbax)", is_maxtext, "deepspeed_ext.checkpoint.maxtext", "MaxTextOptions",
           extra="maxtext", holds_full_tensors=True, widens_weights=True, files_root=maxtext_root,
           model_names=True, imported_by="from-maxtext", written_by="to-maxtext"),
)}
# Each module's ``open_source`` is annotated ``-> CheckpointSource`` (or a class mypy checks against it), so a
# reader missing part of the contract is a type error in its own module; tests/unit/test_types.py checks that
# every entry's module has the functions its entry names.

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
    if not path.is_dir() or (path / LATEST).is_file() or has_deepspeed_files(path):
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


def open_checkpoint(path: str | Path,
                    *,
                    tag: str | None = None,
                    config: str | Path | Mapping[str, Any] | None = None,
                    family: str | None = None,
                    dtype: str = "source",
                    mtp: str | None = None,
                    format: str | None = None,
                    base: str | Path | None = None,
                    reads: str | None = None,
                    command: str | None = None) -> CheckpointSource:
    """The source at ``path`` in whatever format it is (or in ``format``, where the directory holds several).

    ``config``: an HF config (a ``config.json`` path or its dict) to use instead of the recorded one, and for
    the formats that may lack one (HF weights without config.json, MaxText checkpoints not written by
    deepspeed-ext). ``family``: MaxText's model family. ``dtype``: the dtype HF weights are read in. ``mtp``:
    HF layers past ``num_hidden_layers`` (:class:`~deepspeed_ext.checkpoint.source.OpenOptions`). ``base``: a PEFT
    adapter directory's base model (an HF directory).
    ``reads``: the one format the caller (``command``) reads; any other found is refused in one line saying
    what to do with it instead (:func:`not_read`).
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
    readable = [kind for kind in found if reads is None or kind == reads]
    if not readable:
        assert reads is not None
        raise CheckpointError(f"{path}: {not_read(found[0], reads, command or 'this command')}")
    model_config = read_config(config) if isinstance(config, str | Path) else dict(config) if config else None
    return FORMATS[readable[0]].open(path, OpenOptions(tag=tag, model_config=model_config, family=family,
                                                       dtype=dtype, mtp=mtp, base=base))


def not_read(found: str, reads: str, command: str) -> str:
    """What ``command``, which reads ``reads`` checkpoints, says of a ``found`` one: what to run instead, from the
    two formats' registry entries."""
    given, wanted = FORMATS[found], FORMATS[reads]
    if given.imported_by is None:  # already what DeepSpeed resumes from
        return f"already a {given.title} checkpoint, not a {wanted.title} one: {command} is not needed"
    ways = [given.imported_by, *([wanted.written_by] if wanted.written_by not in (None, command) else [])]
    return f"a {given.title} checkpoint, not a {wanted.title} one: convert it with {' or '.join(ways)}"
