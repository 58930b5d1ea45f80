"""The typed joint between readers and writers: every reader is a :class:`CheckpointSource`, every writer
takes one (``write(source, out, options)``).

A source says what it holds in a small :class:`SourceInfo` and streams its parameters as
:class:`~deepspeed_ext.checkpoint.tensor.LogicalTensor` objects, one full tensor at a time. Nothing a writer
needs beyond that is asked of every source: what only a DeepSpeed checkpoint has (its model-states files,
its optimizer's summary) the universal writer takes from a DeepSpeed source and makes up for the others.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from deepspeed_ext.errors import CheckpointError

from deepspeed_ext.checkpoint.states import ADAM_STATES as ADAM_STATES
from deepspeed_ext.checkpoint.states import MASTER_WEIGHTS as MASTER_WEIGHTS
from deepspeed_ext.checkpoint.states import STEP as STEP
from deepspeed_ext.checkpoint.states import has_optimizer

if TYPE_CHECKING:  # torch-free at import: reshard-orbax and the CLI's help need no torch
    import torch

    from deepspeed_ext.checkpoint.fingerprint import Fingerprints
    from deepspeed_ext.checkpoint.tensor import FiniteCheck, LogicalTensor, RecordCheck
    from deepspeed_ext.module_inject.layout import TPLayout


@dataclass(frozen=True)
class SourceInfo:
    """What a checkpoint holds, known once it is opened (before any tensor is read)."""

    #: The format's name in the registry (:mod:`deepspeed_ext.checkpoint.formats`).
    format: str
    #: The path the checkpoint was opened by, as given: errors and reports name it.
    given: Path
    #: The directory the tensors are read from (a DeepSpeed tag, a universal directory, an Orbax item).
    path: Path
    #: Every parameter's TP layout at save time, in the checkpoint's order (TP=1 for HF and MaxText).
    layouts: Mapping[str, TPLayout]
    #: The states any parameter has: ``fp32`` alone, or with its optimizer's (``exp_avg``, ``exp_avg_sq`` and
    #: ``step`` for Adam; ``momentum_buffer`` for SGD; both for Muon, whose groups differ). Each
    #: :class:`~deepspeed_ext.checkpoint.tensor.LogicalTensor` says which of them it has.
    states: tuple[str, ...]
    #: The training step the checkpoint was saved at (0 when it records none).
    global_step: int = 0
    tp_degree: int = 1
    dp_degree: int = 1
    #: DeepSpeed's ZeRO stage (None: not a DeepSpeed checkpoint).
    zero_stage: int | None = None
    #: The DeepSpeed tag (None: the format has no tags).
    tag: str | None = None
    #: The Hugging Face model config (``config.json``): recorded with the checkpoint or given with ``--config``.
    model_config: Mapping[str, Any] | None = None
    #: The model class that was trained, where known (e.g. ``LlamaForCausalLM``).
    model_class: str | None = None
    #: Versions of the software that wrote the checkpoint, where recorded.
    versions: Mapping[str, str] = field(default_factory=dict)
    #: Where the TP layouts come from (``deepspeed_ext``, ``deepspeed``, ``none``).
    metadata: str = "none"
    #: The resume fingerprints recorded with the checkpoint, of the tensors as this reader yields them.
    fingerprints: Fingerprints | None = None
    #: The optimizer's settings as saved (:func:`~deepspeed_ext.checkpoint.states.optimizer_settings`): what another
    #: framework needs to continue the run. None where the checkpoint records none.
    optimizer_settings: Mapping[str, Any] | None = None
    #: The frozen parameters (no optimizer steps them: their weights alone, ``fp32``, whatever the others have).
    frozen: tuple[str, ...] = ()
    #: What shapes a step as the engine that saved it ran it, where deepspeed-ext recorded it (gradient clipping,
    #: accumulation, micro batch, precision: :func:`~deepspeed_ext.checkpoint.engine_private.step_settings`).
    engine_settings: Mapping[str, Any] | None = None
    #: peft adapters trained in it, as recorded (``configs``: each adapter's peft config, as adapter_config.json
    #: holds it; ``active``: the adapters the model ran with), where known: :mod:`~deepspeed_ext.checkpoint.adapters`.
    adapters: Mapping[str, Any] | None = None

    @property
    def has_optimizer(self) -> bool:
        """Whether the parameters carry an optimizer's state (a resume then continues the optimizer)."""
        return has_optimizer(self.states)


@runtime_checkable
class CheckpointSource(Protocol):
    """A checkpoint opened for reading, in any format."""

    @property
    def info(self) -> SourceInfo: ...

    @property
    def read_paths(self) -> list[Path]:
        """Every path reading this checkpoint touches: no output may lie there."""
        ...

    def tensors(self) -> Iterator[LogicalTensor]:
        """The parameters, one :class:`LogicalTensor` each, in the checkpoint's order; nothing read yet."""
        ...

    def summary(self) -> dict[str, Any]:
        """What ``inspect`` shows: plain values only (JSON-serialisable)."""
        ...

    def raise_if_damaged(self) -> None:
        """Raise :class:`~deepspeed_ext.errors.CheckpointError` (one line naming the file) when what was read
        fails the checksums the format records (a DeepSpeed tag: its commit marker, or its zip records'
        CRC-32s); writers call it before they publish. A no-op where the format records none."""
        ...


@runtime_checkable
class CarriesDeepSpeedStates(Protocol):
    """A source that holds DeepSpeed's own engine files (a DeepSpeed tag): the universal writer copies its
    model-states files and optimizer summary, where it writes fresh ones for any other source."""

    def optimizer_state_for_universal(self) -> dict[str, Any]:
        """What ``zero/optimizer_state.pt`` keeps: the optimizer's summary without its per-parameter states."""
        ...

    def copy_model_states(self, directory: Path) -> None:
        """Copy the model-states files (engine state: step, scheduler, client state) into ``directory``."""
        ...


@runtime_checkable
class HasNotes(Protocol):
    """A source with something to say about how it was read (what an HF release was read as: its text model, a
    multi-token-prediction layer left out), shown by the commands before they work."""

    @property
    def notes(self) -> list[str]: ...


@runtime_checkable
class StoresDtypes(Protocol):
    """A source whose tensors are stored in a dtype other than the one it hands out (HF weights read as another
    dtype, block-FP8 weights dequantized): the dtype each parameter has in its files."""

    def file_dtype(self, param: str) -> torch.dtype: ...


@runtime_checkable
class Reshards(Protocol):
    """A source that serves a live engine's restore (:mod:`~deepspeed_ext.checkpoint.restore`): each parameter's
    shard at the engine's TP layout, read by ranges, with the engine files' states (step, scheduler, client
    state) and the optimizer summary. The universal and DeepSpeed readers have it."""

    @property
    def path(self) -> Path: ...

    @property
    def names(self) -> list[str]: ...

    @property
    def has_optimizer_states(self) -> bool: ...

    @property
    def model_states(self) -> dict[str, Any]: ...

    def has(self, name: str, state: str) -> bool: ...

    def states_of(self, name: str) -> tuple[tuple[str, ...], tuple[str, ...]]: ...

    def scalar(self, name: str, state: str) -> torch.Tensor | int: ...

    def resharded(self, name: str, state: str, target: TPLayout, rank: int) -> torch.Tensor: ...

    def resharded_range(self, name: str, state: str, target: TPLayout, rank: int, low: int,
                        high: int) -> torch.Tensor: ...

    def step(self, name: str) -> torch.Tensor | int | None: ...

    def optimizer_state_for_universal(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class WriteOptions:
    """What every writer takes."""

    #: Replace an existing output (only once the new one is complete).
    overwrite: bool = False
    #: Show a progress bar.
    progress: bool = True
    #: The progress bar's label (default: the writer's own name, e.g. "to-universal"); commands that write
    #: through another format's writer name themselves (from-hf writes through the universal writer).
    progress_label: str | None = None
    #: Check every tensor for NaN/Inf and write nothing if any has them.
    check_finite: bool = False
    #: Paths the output may not touch, beyond the source's own.
    protect: Sequence[str | Path] = ()


def protected_paths(source: CheckpointSource, options: WriteOptions) -> list[str | Path]:
    """What an output may not touch: the path the source was named by, every path reading it touches, and
    whatever the caller adds."""
    return [*options.protect, source.info.given, *source.read_paths]


def finite_check(source: CheckpointSource, options: WriteOptions) -> FiniteCheck | None:
    """The NaN/Inf check ``options.check_finite`` asks for, reporting against the path the source was named by."""
    from deepspeed_ext.checkpoint.tensor import FiniteCheck
    return FiniteCheck(str(source.info.given)) if options.check_finite else None


def record_check(info: SourceInfo) -> RecordCheck | None:
    """The check of what a writer reads against the source's record, where the source has one."""
    from deepspeed_ext.checkpoint.tensor import RecordCheck
    return RecordCheck(info.fingerprints, str(info.given)) if info.fingerprints is not None else None


def check_against_record(info: SourceInfo, found: Fingerprints, names: list[str]) -> None:
    """Refuse to publish tensors that disagree with the fingerprints their source recorded: the source was
    damaged after it was saved, or read wrongly. ``names``: the tensors written, each with every state the
    record has. Nothing to check where the source recorded none."""
    from deepspeed_ext.checkpoint.fingerprint import SOURCE_WRONG, compare, mismatch_message
    recorded = info.fingerprints
    if recorded is None:
        return
    checked, mismatches = compare(recorded.subset(names), found, check_step=False)
    if mismatches:
        raise CheckpointError(mismatch_message(str(info.given), mismatches, checked, SOURCE_WRONG))


def frozen_summary(layouts: Mapping[str, TPLayout], frozen: Iterable[str]) -> dict[str, str]:
    """What ``inspect`` says of a checkpoint's frozen parameters (nothing where it has none)."""
    names = [name for name in frozen if name in layouts]
    if not names:
        return {}
    return {"frozen_parameters": f"{len(names)} of {len(layouts)} parameters, "
                                 f"{sum(layouts[name].numel for name in names)} elements (weights only: no optimizer "
                                 "steps them)"}


def required_model_config(info: SourceInfo) -> dict[str, Any]:
    """The HF model config a writer needs (to-hf, to-maxtext), or one line on how to supply it."""
    if not info.model_config:
        raise CheckpointError(f"{info.path}: no model config saved with the checkpoint (deepspeed_ext.json); pass "
                              "--config config.json (the model's HF config)")
    return dict(info.model_config)


@dataclass(frozen=True)
class OpenOptions:
    """What opening a checkpoint may be told; each format uses what applies to it."""

    #: The DeepSpeed tag to read (None: the save directory's ``latest`` or ``latest_universal``).
    tag: str | None = None
    #: The HF model config to use instead of the one recorded with the checkpoint.
    model_config: Mapping[str, Any] | None = None
    #: MaxText: the model family (None: recorded, else inferred from the model config).
    family: str | None = None
    #: Hugging Face: the dtype weights are read in (``source``: the files' own).
    dtype: str = "source"
    #: Hugging Face: decoder layers past ``num_hidden_layers`` (DeepSeek-V3's multi-token prediction): None
    #: refuses them, ``drop`` leaves them out, ``keep`` writes them back into an HF output.
    mtp: str | None = None
    #: A PEFT adapter directory's base model (an HF directory; None: the local directory its
    #: ``base_model_name_or_path`` names, if there is one).
    base: str | Path | None = None
